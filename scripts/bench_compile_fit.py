"""The --fit table of scripts/bench_compile.py: each xsched plan's first compiled step against its budget."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from xsched.pipeline import PER_OP_KEY


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def publish(lines: list[str], out: Path | None) -> None:
    """The table printed, and appended to `out` (--out) when given."""
    text = "\n".join(lines) + "\n"
    print(text)
    if out:
        with out.open("a") as f:
            f.write(text)


def fit_table(a: argparse.Namespace, fit: Callable[[float], list[str]], ref: int) -> int:
    """--fit: `fit(frac)` (one table row per plan solved at frac of torch.compile's peak) for each of --budgets,
    --repeat times."""
    lines = [
        f"Command: `python scripts/bench_compile.py {' '.join(sys.argv[1:])}`, torch.compile's measured peak "
        f"{ref:,} B. All bytes with the params and inputs (the plan counts them; the step's peak column adds them).",
        "",
        "| budget | per-op count | first compiled step | what wrap did | cuts (parts compiled to choose them) | setup: wrap + steps to settle "
        "| settled: predicted | measured | predicted - measured |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for frac in [float(f) for f in a.budgets.split(",") if f]:
        for k in range(a.repeat):
            log(f"planning at {frac:.0%} of torch.compile's peak, try {k + 1} of {a.repeat}")
            lines += fit(frac)
    publish(lines, a.out)
    return 0


def fit_row(
    w: torch.nn.Module, said: list[str], measured: int, plan_dev: str, frac: float, setup: tuple[float, float]
) -> str:
    """One --fit row: the plan's budget and per-op count, its first compiled step's peak (wrap's notice of it, or
    within the budget when there is none), the regions split and the cuts made, the seconds wrap and the steps
    until settled took (`setup`), the settled prediction beside `measured`."""
    c = w._first  # type: ignore[attr-defined]
    mib = lambda b: f"{b / 2**20:.3f} MiB"  # noqa: E731
    first = next((ln for ln in said if "the compiled plan peaked at" in ln), None)
    count = lambda what: sum(what in ln for ln in said)  # noqa: E731
    before = count("its compiled code peaks at")  # split before they ran, by their generated code
    did = f"{before} regions split before they ran"
    did += f", then {count('over the budget split')} rounds of splits ({count('split before step') - before} regions)"
    did += f", {count('planning again')} re-plans" if count("planning again") else ""
    did += f", {count('runs uncompiled')} regions uncompiled" if count("runs uncompiled") else ""
    at = first.split(" at cpu ")[1].split(" over ")[0] if first else "within it"
    budget, pred = c.plan.budgets[plan_dev], c.plan.predicted.peak_bytes[plan_dev]
    return (
        f"| {mib(budget)} ({frac:.0%}) | {mib(c.plan.extra[PER_OP_KEY][plan_dev])} | {at} | "
        f"{did} | {len(c.executor.segments.cuts)} ({getattr(c.executor.segments, 'tried_parts', 0)}) | {setup[0]:.0f} + {setup[1]:.0f} s | {mib(pred)} | {mib(measured)} | {pred - measured:+,} B "
        f"({(pred - measured) / measured:+.2%}) |"
    )
