"""The training launcher behind `xsched train`: plan once (cached), train through `xsched.wrap` with DDP across
torchrun's ranks, checkpoint atomically and resume (`loop`, `plans`, `checkpoint`, `dist`, `meters`, `progress`)."""

from xsched.train.loop import StepRecord, TrainConfig, TrainResult, train

__all__ = ["StepRecord", "TrainConfig", "TrainResult", "train"]
