"""Where an xsched compiled row's setup goes (scripts/bench_compile.py): capture, profile, solves, region compiles;
the row's notes that say so."""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock

import torch

import xsched.execute.segments as segments
import xsched.execute.wrap  # noqa: F401  # the module, not the function xsched.execute re-exports under its name
from xsched.contracts.plan import Compute
from xsched.pipeline import PER_OP_KEY

WRAP = sys.modules["xsched.execute.wrap"]
# (module, attribute, phase): the calls wrap makes for each plan it solves, and the region compiler the executor's
# compiled segments call once per region and input shapes (a cache hit of inductor's FX graph cache included)
PHASES = (
    (WRAP, "capture", "capture"),
    (WRAP, "stored_profile", "profile"),
    (WRAP, "solve_plan", "solve"),
    (segments, "_inductor", "region compiles"),
)


class PhaseClock:
    """Seconds and calls per phase while `timing()` is open; `.total()` sums them."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}

    def _timed(self, phase: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - t0
                self.calls[phase] = self.calls.get(phase, 0) + 1

        return call

    @contextlib.contextmanager
    def timing(self) -> Iterator[PhaseClock]:
        """Each phase's function replaced by a timed one of it (restored on exit)."""
        with contextlib.ExitStack() as stack:
            for module, name, phase in PHASES:
                stack.enter_context(mock.patch.object(module, name, self._timed(phase, getattr(module, name))))
            yield self

    def add(self, phase: str, seconds: float) -> None:
        """A phase timed outside (the first steps until the plan settles, less the compiles inside them)."""
        self.seconds[phase] = self.seconds.get(phase, 0.0) + seconds
        self.calls[phase] = self.calls.get(phase, 0) + 1

    def total(self) -> float:
        return sum(self.seconds.values())

    def said(self) -> str:
        """`capture 3.0 s (1), profile 13.9 s (1), ...`: each phase's seconds and calls, in the order they ran."""
        return ", ".join(f"{k} {s:.1f} s ({self.calls[k]})" for k, s in self.seconds.items())


def xsched_notes(w: torch.nn.Module, said: list[str], plan_dev: str, before: int, clock: PhaseClock) -> list[str]:
    """An xsched row's notes: how its plan was found, its recomputes and counts, wrap's notices, where its setup
    went (the phases, the regions compiled and measured, the cuts)."""
    c = w._first  # type: ignore[attr-defined]
    recomputes = sum(isinstance(s, Compute) for s in c.plan.steps) - len(c.graph.ops)
    per_op = c.plan.extra[PER_OP_KEY][plan_dev] - before
    within = c.plan.extra.get("planned_within", {}).get(plan_dev)
    again = f", re-planned within {within - before:,} B" if within else ""
    seg = c.executor.segments
    return [
        f"plan by {c.plan.solver.method}{again}, {recomputes} recomputes, per-op count {per_op:,} B, budget "
        f"{c.plan.budgets[plan_dev] - before:,} B (less params and inputs)",
        *said,
        f"setup {clock.total():.0f} s: {clock.said()}; regions measured {len(seg.peaks)}, uncompiled "
        f"{len(seg.failed)}, cuts {len(seg.cuts)} ({seg.tried_parts} parts compiled to choose them)",
    ]
