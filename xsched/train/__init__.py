"""The training launcher behind `xsched train`: plan once (cached), train through `xsched.wrap` with DDP across
torchrun's ranks, in bf16/fp16 autocast with loss scaling, gradient accumulation, clipping and learning-rate
schedules, on zoo, factory, Hugging Face (`hf`) models and token files (`data`); evaluate, checkpoint atomically
and resume (`config`, `session`, `loop`, `optim`, `schedule`, `data`, `hf`, `plans`, `checkpoint`, `dist`,
`meters`, `records`, `progress`)."""

from xsched.train.config import TrainConfig
from xsched.train.loop import train
from xsched.train.records import StepRecord, TrainResult

__all__ = ["StepRecord", "TrainConfig", "TrainResult", "train"]
