"""The timed rows of scripts/bench_compile.py: their order, the --deadline's estimates, and the table and JSON written
after every row (a run killed at its timeout keeps what it measured)."""

from __future__ import annotations

import contextlib
import json
import signal
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

# A row's setup (compiles, plans) before one like it has run, seconds: the H100 (GPT-2 6 layers, b8, T1024) compiled
# torch.compile in 29 s, with activation_memory_budget 0.5 in 43 s (1.5x: the budget's partition search); the shared
# 2-core CPU (gpt2 small, load 4-11) torch.compile in 184 s with inductor's cache cold, 9-22 s from it, with
# activation_memory_budget 0.5 in 64 s cold, and its first xsched compiled row in 110 s (77 s of it inductor's C++
# builds of 2 regions, 24 s its profile). An xsched row's guess adds its solve's time limit; after a row of its kind,
# its own setup (1.5x for a torch.compile row: activation_memory_budget's search; one compiled from inductor's cache
# is not counted).
FIRST_SETUP_S = {("torch", "cuda"): 30.0, ("torch", "cpu"): 60.0, ("xsched", "cuda"): 45.0, ("xsched", "cpu"): 100.0}
MIN_SOLVE_S = 2.0  # the shortest solve --deadline gives a plan
SOLVE_SHARE = 0.1  # of the seconds left before --deadline: a solve's time limit under it


def row_order(fracs: list[float], eager_plan: bool) -> list[tuple[str, float | None]]:
    """(kind, fraction of torch.compile's peak) per row, the most informative first: torch.compile, xsched compiled
    at torch.compile's measured peak, then per fraction xsched compiled and torch.compile's activation_memory_budget
    at it; the xsched compiled eager plan and eager PyTorch last."""
    order: list[tuple[str, float | None]] = [("torch", 1.0), ("xsched", 1.0)]
    for f in dict.fromkeys(f for f in fracs if f != 1.0):
        order += [("xsched", f), ("torch", f)]
    return [*order, *([("xsched eager plan", None)] if eager_plan else []), ("eager", None)]


def label_of(kind: str, frac: float | None) -> str:
    if kind == "torch":
        return "torch.compile" if frac == 1.0 else f"torch.compile, activation_memory_budget={frac}"
    if kind == "xsched":
        return f"xsched compiled, {frac:.0%} of torch.compile's peak"
    return "xsched compiled eager plan" if kind == "xsched eager plan" else "eager PyTorch"


class DeadlineReached(BaseException):
    """--deadline passed during a row (SIGALRM): a BaseException, so no `except Exception` on the way (a region
    compile that fails runs uncompiled) swallows it."""


class Deadline:
    """Seconds left before --deadline (none: never short), and whether a row's expected seconds fit in them."""

    def __init__(self, seconds: float | None, device: str) -> None:
        self.end = None if seconds is None else time.perf_counter() + seconds
        self.device = "cuda" if device.startswith("cuda") else "cpu"
        self.setup: dict[str, list[float]] = {}  # kind -> the setups measured ("torch", "xsched")
        self.step_s = 0.0  # the slowest median step measured

    def left(self) -> float:
        return float("inf") if self.end is None else self.end - time.perf_counter()

    def solve_limit(self, time_limit: float) -> float:
        """The solver's time limit for the next plan: `time_limit`, at most SOLVE_SHARE of what is left."""
        return time_limit if self.end is None else min(time_limit, max(MIN_SOLVE_S, SOLVE_SHARE * self.left()))

    def expected(self, kind: str, iters: int, time_limit: float) -> float:
        """A row's seconds: its setup (FIRST_SETUP_S, or the last of its kind's), then its warm-up, its peak (the
        allocator's events traced: on the CPU the profiler's cost, a few steps') and `iters` steps interleaved with
        torch.compile's, each at twice the slowest median step so far (load comes in bursts)."""
        base = "torch" if kind == "torch" else "xsched" if kind.startswith("xsched") else None
        done = self.setup.get(base or "", [])
        if base is None:
            setup = 0.0
        elif done and base == "torch":  # compiles from inductor's cache are not in `done`
            setup = 1.5 * done[-1]
        elif done:
            setup = done[-1]
        else:
            setup = FIRST_SETUP_S[(base, self.device)] + (self.solve_limit(time_limit) if base == "xsched" else 0.0)
        return setup + (4 + 2 * iters) * 2 * self.step_s

    @contextlib.contextmanager
    def stopping(self) -> Iterator[None]:
        """The row inside raises DeadlineReached when the deadline passes (a row's setup can take far more than
        expected: 44 region compiles where the row before took 2), so the table is still written in time."""
        if self.end is None or not hasattr(signal, "setitimer"):
            yield
            return

        def stop(signum: int, frame: object) -> None:
            raise DeadlineReached

        old = signal.signal(signal.SIGALRM, stop)
        signal.setitimer(signal.ITIMER_REAL, max(self.left(), 0.001))
        try:
            yield
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old)

    def skip(self, kind: str, iters: int, time_limit: float) -> str | None:
        """ "skipped: N s left of --deadline" where the row is not expected to finish, else None."""
        left, need = self.left(), self.expected(kind, iters, time_limit)
        return f"skipped: {left:.0f} s left of --deadline, about {need:.0f} s needed" if left < need else None


def measured(
    fn: Callable[[], torch.Tensor],
    params: list[torch.Tensor],
    ref: Callable[[], torch.Tensor] | None,
    iters: int,
    step_peak: Callable[..., int],
    timed: Callable[..., dict[str, list[float]]],
) -> dict[str, Any]:
    """A row's warm-up step, its peak, and `iters` steps interleaved with torch.compile's (`ref`; None: this is
    torch.compile's row, or it did not run): the medians and best steps of both, so its ratio shares the machine's
    load (None without `ref`)."""
    fn().backward()
    peak = step_peak(fn, params)
    steps = timed({"row": fn, **({"ref": ref} if ref is not None else {})}, iters)
    ref_steps = steps.get("ref")
    return {
        "time_s": statistics.median(steps["row"]),
        "best_s": min(steps["row"]),
        "ref_time_s": statistics.median(ref_steps) if ref_steps else None,
        "ref_best_s": min(ref_steps) if ref_steps else None,
        "peak": peak,
    }


def table(rows: list[dict[str, Any]], header: list[str], footer: list[str]) -> list[str]:
    """The markdown: `header`, a line per row (a skipped or failed one says why), every row's notes, `footer`."""
    ref_peak = next((r["peak"] for r in rows if r["row"] == "torch.compile" and "peak" in r), None)
    lines = [
        *header,
        "",
        "| row | step time (median) | vs torch.compile | best step | vs torch.compile | measured peak "
        "| vs torch.compile | xsched predicted peak | setup |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['row']} | {r['error']} | | | | | | | |")
            continue
        pred = f"{r['predicted'] / 2**20:.2f} MiB" if r.get("predicted") is not None else "-"
        vs_peak = f"{r['peak'] / ref_peak:.0%}" if ref_peak else "-"
        vs = [f"{r[k] / r[f'ref_{k}']:.3f}x" if r[f"ref_{k}"] else "-" for k in ("time_s", "best_s")]
        lines.append(
            f"| {r['row']} | {r['time_s'] * 1e3:.1f} ms | {vs[0]} | {r['best_s'] * 1e3:.1f} ms | {vs[1]} "
            f"| {r['peak'] / 2**20:.2f} MiB | {vs_peak} | {pred} | {r['setup_s']:.0f} s |"
        )
    notes = [f"- {r['row']}: {n}" for r in rows for n in r.get("notes", [])]
    return [*lines, "", *notes, *footer]


def write(lines: list[str], rows: list[dict[str, Any]], facts: dict[str, Any], out: Path | None, js: Path | None):
    """The table to `out` and the rows with the run's facts to `js` (each overwritten: called after every row)."""
    if out:
        out.write_text("\n".join(lines) + "\n")
    if js:
        js.write_text(json.dumps({"facts": facts, "rows": rows}, indent=1, default=str))
