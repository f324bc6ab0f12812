"""Learning-rate schedules of `xsched train`: a linear warmup, then constant, cosine or linear decay to a floor.
The rate is a pure function of the step, so a resumed run is at the same position as an uninterrupted one."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Schedule:
    """lr_at(step) for 0-based optimizer steps: `warmup` steps rise linearly to `lr` (step s gets lr·(s+1)/warmup),
    then `name` runs over the remaining `horizon - warmup` steps: constant keeps `lr`; cosine and linear fall from
    `lr` to `min_lr`, reached at step `horizon` (the run's total steps)."""

    name: str
    lr: float
    warmup: int = 0
    min_lr: float = 0.0
    horizon: int = 1

    def lr_at(self, step: int) -> float:
        if step < self.warmup:
            return self.lr * (step + 1) / self.warmup
        if self.name == "constant":
            return self.lr
        progress = min(1.0, (step - self.warmup) / max(1, self.horizon - self.warmup))
        if self.name == "cosine":
            fall = 0.5 * (1.0 + math.cos(math.pi * progress))
        else:  # linear
            fall = 1.0 - progress
        return self.min_lr + (self.lr - self.min_lr) * fall

    def describe(self) -> dict[str, Any]:
        """What a checkpoint records of the schedule (a resumed run must have the same): the horizon only where
        the rate falls, since a constant rate does not depend on the run's length."""
        out: dict[str, Any] = {"name": self.name, "lr": self.lr, "warmup": self.warmup}
        if self.name != "constant":
            out |= {"min_lr": self.min_lr, "horizon": self.horizon}
        return out
