"""What a training run reports: one `StepRecord` per optimizer step, the `TrainResult`, and the `Reporter` that
shows them as they happen (rank 0 only; xsched.train.progress has a bar, JSON lines and a CSV log)."""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from xsched.train.host_adamw import OverlapStats


@dataclass(frozen=True)
class StepRecord:
    """One optimizer step: its 0-based index, the training loss averaged over the ranks and micro-batches (the
        combined batch's loss), the learning rate it used, the total gradient norm before clipping, rank 0's wall
        time, the token ids per second over all ranks (None when the inputs are not token ids), peak bytes per device
        and energy (each with its source), the fp16 loss scale after the step (None otherwise), and the validation
        loss when the run evaluated after this step, and where its time went (the executor's lanes and runs, the host
    optimizer's buckets and the waits for them)."""

    step: int
    loss: float
    lr: float
    grad_norm: float
    step_s: float
    tokens_per_s: float | None
    peak_bytes: Mapping[str, int]
    peak_source: Mapping[str, str]
    energy_j: float | None
    energy_source: str
    loss_scale: float | None = None
    val_loss: float | None = None
    breakdown: Mapping[str, Any] | None = None  # where the step's time went (xsched.execute.step_clock), seconds


@dataclass(frozen=True)
class TrainResult:
    start_step: int  # the step this run began at (0, or the resumed checkpoint's)
    records: tuple[StepRecord, ...]
    plan_path: Path
    plan_reused: bool
    checkpoint: Path | None  # the last checkpoint written (rank 0), if any
    world: int = 1
    time_s: float = 0.0  # the steps' wall time (evaluations included)
    setup_s: float = 0.0  # loading, capturing, planning (or finding the cached plan), resuming
    optimizer: OverlapStats | None = None  # the host optimizer's time and the share hidden behind the backward
    setup_stages: Mapping[str, float] = field(default_factory=dict)  # seconds of each stage of setup_s (SetupLaps)

    @property
    def losses(self) -> list[float]:
        return [r.loss for r in self.records]

    @property
    def val_losses(self) -> dict[int, float]:
        """Step -> the validation loss measured after it."""
        return {r.step: r.val_loss for r in self.records if r.val_loss is not None}

    @property
    def final_val_loss(self) -> float | None:
        vals = self.val_losses
        return vals[max(vals)] if vals else None


class SetupLaps:
    """The seconds of each stage of a run's setup, in the order they end: each `lap(stage)` adds the time since the
    previous lap (or since the laps began) to `stage`."""

    def __init__(self) -> None:
        self.stages: dict[str, float] = {}
        self._t = time.perf_counter()

    def lap(self, stage: str) -> None:
        t = time.perf_counter()
        self.stages[stage] = self.stages.get(stage, 0.0) + t - self._t
        self._t = t


def setup_text(stages: Mapping[str, float]) -> str:
    """Setup stages in words, e.g. "model 2.1 s, capture 8.0 s, plan 60.3 s"."""
    return ", ".join(f"{k} {v:.1f} s" for k, v in stages.items())


class Reporter(Protocol):
    """Where a run's progress goes (rank 0 only)."""

    def start(self, info: Mapping[str, Any]) -> None: ...
    def step(self, record: StepRecord) -> None: ...
    def checkpoint(self, step: int, path: Path) -> None: ...
    def notice(self, text: str) -> None: ...
    def end(self, result: TrainResult) -> None: ...
    def close(self) -> None: ...  # also after a failure: the error is then printed on a line of its own


class Quiet:
    """No progress; notices still go to stderr as one line each, naming the rank when it is not rank 0."""

    def __init__(self, rank: int = 0) -> None:
        self.prefix = f"xsched train [rank {rank}]" if rank else "xsched train"

    def start(self, info: Mapping[str, Any]) -> None: ...
    def step(self, record: StepRecord) -> None: ...
    def checkpoint(self, step: int, path: Path) -> None: ...
    def end(self, result: TrainResult) -> None: ...
    def close(self) -> None: ...

    def notice(self, text: str) -> None:
        print(f"{self.prefix}: {text}", file=sys.stderr, flush=True)
