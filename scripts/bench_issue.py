"""Who issues a GPU plan's steps (issue 30; Executor(issue=...)): a thread per lane against the training thread alone,
on the CUDA path's host side, without a GPU. `xsched train --param-home cpu:1 --store cpu:1` of a deep, narrow
GPT-2 whose every op computes in microseconds (as bench_host_overhead's), its executor's compute and copy lanes made
CUDA lanes on the fake streams and events of tests/lane_cost_support.py (each step still runs its op on the CPU, the
lanes record and wait for events as on a GPU, and the host AdamW runs beside them), its steps issued by lanes and by
one thread in turn, one session, so the load weighs on both alike and their losses are one training run's.

    python scripts/bench_issue.py                               # 48 layers, n_embd 64: ~2,000 ops a step
    python scripts/bench_issue.py --layers 2 --steps 4          # the test's size

Per row, medians a step after `--warmup` of its steps: the wall; the training thread's CPU (one issuer: all the
issuing); the process's CPU (every thread); the compute tasks' wall and their thread's CPU per op (the step clock's
compute_issue_s / compute_issue_cpu_s: wall less CPU is waiting, for the GIL or a core); the context switches of the
threads that ran compute tasks (in brackets those the machine forced); and the copies' tasks' wall. On a CPU a
kernel runs inside its issue (a GPU's is queued), so the walls bound what issuing costs; the counts do not depend
on it.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from bench_host_overhead import eager_and_wrap, graph_ops, lanes_session, offload_setup
from bench_param_offload_rows import xsched_run

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from lane_cost_support import fake_cuda  # noqa: E402

KEYS = ("compute_issue_s", "compute_issue_cpu_s", "compute_switches", "compute_preempted", "copy_in_issue_s")
KEYS += ("copy_out_issue_s",)
LOSS_RTOL = 1e-4  # as bench_host_overhead: the same arithmetic, fp32 sums in another order


def run(setup: dict[str, Any], modes: list[str], steps: int) -> dict[str, dict[str, list[float]]]:
    """One session on fake CUDA lanes; step s issued as modes[s % len(modes)] says; per mode its figures."""
    from xsched.train import dist
    from xsched.train.loop import _step

    session, world = lanes_session(setup)
    ex = session.wrapped._first.executor
    rows: dict[str, dict[str, list[float]]] = {
        m: {"step_s": [], "cpu_s": [], "process_s": [], "losses": []} for m in modes
    }
    for r in rows.values():
        r.update({k: [] for k in KEYS})
    try:
        with pytest.MonkeyPatch.context() as mp:
            fake_cuda(ex, mp)
            for s in range(steps * len(modes)):
                mode = modes[s % len(modes)]
                ex.issue = mode
                t0, c0, p0 = time.perf_counter(), time.thread_time(), time.process_time()
                record = _step(session, s, world, 1)
                row = rows[mode]
                row["step_s"].append(time.perf_counter() - t0)
                row["cpu_s"].append(time.thread_time() - c0)
                row["process_s"].append(time.process_time() - p0)
                row["losses"].append(record.loss)
                for k in KEYS:
                    row[k].append(record.breakdown.get(k, float("nan")))
    finally:
        session.updater.close()
        ex.close()
        dist.leave(world)
    return rows


def table(rows: dict[str, dict[str, list[float]]], ops: int, warmup: int, eager: list[float]) -> list[str]:
    """One line per row, medians a step after the warm-up; its losses against eager PyTorch's at the same steps."""
    lines = [
        "| issued by | steps | wall: median step | vs lanes | training thread CPU | process CPU | compute tasks: wall "
        "per op | their thread CPU per op | waiting per op | compute threads' context switches (preempted) | copies "
        "in / out: tasks' wall | losses = eager |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    base = statistics.median(rows["lanes"]["step_s"][warmup:]) if "lanes" in rows else None
    for k, (mode, r) in enumerate(rows.items()):
        want = eager[k :: len(rows)]  # this row's steps of the one run
        same = all(abs(x - y) <= LOSS_RTOL * abs(y) for x, y in zip(r["losses"], want, strict=True))

        def med(k: str, r: dict[str, list[float]] = r) -> float:
            return statistics.median(r[k][warmup:])

        wait = statistics.median(
            w - c for w, c in zip(r["compute_issue_s"][warmup:], r["compute_issue_cpu_s"][warmup:])
        )
        vs = f"{med('step_s') / base:.2f}x" if base else "-"
        label = "lanes (a thread per lane)" if mode == "lanes" else "one (the training thread)"
        lines.append(
            f"| {label} | {len(r['step_s']) - warmup} | {med('step_s') * 1e3:.1f} ms | {vs} | {med('cpu_s') * 1e3:.1f} ms "
            f"| {med('process_s') * 1e3:.1f} ms | {med('compute_issue_s') / ops * 1e6:.1f} us "
            f"| {med('compute_issue_cpu_s') / ops * 1e6:.1f} us | {wait / ops * 1e6:.1f} us "
            f"| {med('compute_switches'):.0f} ({med('compute_preempted'):.0f}) "
            f"| {med('copy_in_issue_s') * 1e3:.1f} / {med('copy_out_issue_s') * 1e3:.1f} ms | {'yes' if same else 'NO'} |"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--embd", type=int, default=64)
    ap.add_argument("--seq", type=int, default=16)
    ap.add_argument("--budget", default="12MiB", help="cpu:0's budget (parameters: 9.2 MiB at the default size)")
    ap.add_argument("--steps", type=int, default=20, help="steps per row, the warm-up included")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--cache-dir", help="keep the capture, costs and plan here (default: temporary)")
    a = ap.parse_args(argv)
    if a.steps <= a.warmup or a.warmup < 0:
        print("bench_issue: --steps must exceed --warmup >= 0", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    with contextlib.ExitStack() as stack:
        cache = a.cache_dir or stack.enter_context(tempfile.TemporaryDirectory())
        setup = offload_setup(a, a.steps, cache, "park", 60.0)
        ops = graph_ops(setup)
        eager = eager_and_wrap({**setup, "steps": 2 * a.steps}, ["eager"])["eager"]["losses"]
        xsched_run({**setup, "steps": 1}, "gpt2", setup["scale"], setup["budget"])  # plans into the cache
        load = os.getloadavg()[0]
        rows = run(setup, ["lanes", "one"], a.steps)
    cmd = " ".join(["python scripts/bench_issue.py", *(sys.argv[1:] if argv is None else argv)])
    print(f"# Who issues the steps: GPT-2 {setup['scale']}, {ops} ops a training step, fake CUDA lanes\n")
    print(f"Command: `{cmd}`  ")
    print(
        f"CPU, {os.cpu_count()} cores, 1 torch thread; torch {torch.__version__}, Python {platform.python_version()}; "
        f"load {load:.1f} at the start; {time.perf_counter() - t0:.0f} s in all; the two rows' steps alternate in one "
        "training run, compared step by step with eager PyTorch's\n"
    )
    lines = table(rows, ops, a.warmup, eager)
    print("\n".join(lines))
    return 1 if any(line.endswith("| NO |") for line in lines) else 0


if __name__ == "__main__":
    sys.exit(main())
