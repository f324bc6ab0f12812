"""The training launcher behind `xsched train`: plan once (cached), train through `xsched.wrap` with DDP across
torchrun's ranks, in bf16/fp16 autocast with loss scaling, gradient accumulation, clipping and learning-rate
schedules, on zoo, factory, Hugging Face (`hf`, LoRA adapters in `lora`) models and token files (`data`); evaluate, checkpoint atomically
and resume (`config`, `session`, `plan_wrap`, `loop`, `optim`, `schedule`, `data`, `hf`, `plans`, `checkpoint`, `dist`,
`meters`, `records`, `progress`); `hf_trainer` runs transformers' Trainer through plans."""

from xsched.train.config import TrainConfig
from xsched.train.loop import train
from xsched.train.records import StepRecord, TrainResult

__all__ = ["StepRecord", "TrainConfig", "TrainResult", "train"]
