"""The host optimizer's share of the cores beside the threads that issue the plan (issue 30; xsched.train.host_share),
on logical CPUs: `xsched train --param-home cpu:1 --store cpu:1` of a deep GPT-2 whose AdamW is about as long as its
step's issuing, its executor on lanes (a thread per stream, as on a GPU), once per share of `--shares` (the host
AdamW's torch threads : the nice increment of its worker), each its own session (a worker's nice value cannot be
lowered again), their steps run in blocks, the sessions in turn, so the machine's load weighs on each alike.

    python scripts/bench_host_share.py                          # 24 layers, n_embd 256: 19M parameters
    python scripts/bench_host_share.py --shares all:0,1:0,all:10,1:10 --rounds 6 --block 4
    python scripts/bench_host_share.py --layers 2 --embd 64 --budget 1MiB --rounds 1 --block 3   # the test's size

The compute lane computes here (a GPU's only issues), with one torch thread, so the host AdamW at all the cores
contends with it for a core as, on the H100's 16, sixteen AdamW threads contend with the lanes. Each block's first
step is left out (the block before it settled its session's updates). Per row, medians a step: the wall; the
compute lane's tasks' wall, their thread CPU and the difference (waiting: for the GIL or a core) per op; its
context switches (in brackets those the machine forced) and run-queue wait (ready, no core free); the host AdamW's
busy time and the time the run waited for it; and whether its losses equal the first row's (every row trains the
same weights on the same batches: AdamW's threads do not change its arithmetic).
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
from typing import Any

import torch
from bench_host_overhead import BREAKDOWN, graph_ops, lanes_session, offload_setup
from bench_param_offload_rows import xsched_run

from xsched.train.host_share import available_cores

LOSS_RTOL = 1e-5


def parse_shares(text: str) -> list[tuple[int, int]]:
    """`threads:nice,...` (threads a count or all: every core, as torch's count is on a GPU machine, where the
    lanes do not compute) as (threads, nice) pairs; ValueError where one is not."""
    out: list[tuple[int, int]] = []
    for item in text.split(","):
        threads, nice = item.split(":")
        out.append((available_cores() if threads == "all" else int(threads), int(nice)))
    return out


def run_rows(setup: dict[str, Any], shares: list[tuple[int, int]], rounds: int, block: int) -> dict[str, Any]:
    """Every share's session, `rounds` blocks of `block` steps each, the sessions in turn; per row its steps'
    figures (the first of each block left out) and losses (all)."""
    from xsched.train.loop import _step

    sessions = [lanes_session(setup, host_threads=t, host_nice=n) for t, n in shares]
    rows: dict[str, Any] = {}
    for (session, _), (t, n) in zip(sessions, shares):
        rows[f"{t}:{n}"] = {
            "share": session.updater.host.share_note,
            "step_s": [],
            "losses": [],
            **{k: [] for k in BREAKDOWN},
        }
    try:
        for r in range(rounds):
            for (session, world), row in zip(sessions, rows.values()):
                for b in range(block):
                    s = r * block + b
                    t0 = time.perf_counter()
                    record = _step(session, s, world, 1)
                    wall = time.perf_counter() - t0
                    row["losses"].append(record.loss)
                    if b == 0:
                        continue  # the block before left nothing to overlap with
                    row["step_s"].append(wall)
                    for k in BREAKDOWN:
                        row[k].append(record.breakdown.get(k, float("nan")))
                session.updater.settle()  # the next session's block starts on a host with no update under way
    finally:
        for session, _ in sessions:
            session.updater.close()
        from xsched.train import dist

        dist.leave(sessions[0][1])
    return rows


def table(rows: dict[str, Any], ops: int) -> list[str]:
    """One line per share, medians a step."""
    lines = [
        "| host AdamW share (threads : nice) | as taken | steps | wall: median step | vs first row | compute lane: "
        "tasks' wall per op | CPU per op | waiting per op | its context switches (preempted) | its run-queue wait "
        "| AdamW busy | run waited for AdamW | losses = first row |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    first = next(iter(rows.values()))
    base = statistics.median(first["step_s"])
    for key, r in rows.items():

        def med(k: str, r: dict[str, Any] = r) -> float:
            return statistics.median(r[k])

        wall = med("step_s")
        waiting = statistics.median(w - c for w, c in zip(r["compute_issue_s"], r["compute_issue_cpu_s"]))
        same = all(abs(a - b) <= LOSS_RTOL * abs(b) for a, b in zip(r["losses"], first["losses"]))
        lines.append(
            f"| {key} | {r['share']} | {len(r['step_s'])} | {wall * 1e3:.1f} ms | {wall / base:.2f}x "
            f"| {med('compute_issue_s') / ops * 1e6:.1f} us | {med('compute_issue_cpu_s') / ops * 1e6:.1f} us "
            f"| {waiting / ops * 1e6:.1f} us | {med('compute_switches'):.0f} ({med('compute_preempted'):.0f}) "
            f"| {med('compute_ready_s') * 1e3:.1f} ms | {med('optimizer_s') * 1e3:.1f} ms "
            f"| {med('optimizer_wait_read_s') * 1e3:.1f} ms | {'yes' if same else 'NO'} |"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--embd", type=int, default=256)
    ap.add_argument("--seq", type=int, default=16)
    ap.add_argument("--budget", default="100MiB", help="cpu:0's budget (the parameters: 72.4 MiB at the default size)")
    ap.add_argument("--shares", default="all:0,1:0,all:10,1:10", help="threads:nice,... (threads a count or all)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--block", type=int, default=4, help="steps a session runs in turn; its first is left out")
    ap.add_argument("--method", default="park")
    ap.add_argument("--time-limit", type=float, default=60.0)
    ap.add_argument("--cache-dir", help="keep the capture, costs and plan here (default: temporary)")
    a = ap.parse_args(argv)
    try:
        shares = parse_shares(a.shares)
    except ValueError:
        shares = []
    if not shares or a.rounds < 1 or a.block < 2:
        why = "--block must be at least 2, --rounds at least 1" if shares else f"bad --shares {a.shares!r}"
        print(f"bench_host_share: {why}", file=sys.stderr)
        return 2
    torch.set_num_threads(1)  # the lanes compute with one thread; "all" gives the host AdamW every core
    t0 = time.perf_counter()
    with contextlib.ExitStack() as stack:
        cache = a.cache_dir or stack.enter_context(tempfile.TemporaryDirectory())
        setup = offload_setup(a, a.rounds * a.block, cache, a.method, a.time_limit)
        ops = graph_ops(setup)
        xsched_run({**setup, "steps": 1}, "gpt2", setup["scale"], setup["budget"])  # plans into the cache
        load = os.getloadavg()[0]
        rows = run_rows(setup, shares, a.rounds, a.block)
    cmd = " ".join(["python scripts/bench_host_share.py", *(sys.argv[1:] if argv is None else argv)])
    print(f"# The host AdamW's share: GPT-2 {setup['scale']}, {ops} ops a training step\n")
    print(f"Command: `{cmd}`  ")
    print(
        f"CPU, {os.cpu_count()} cores, lanes at 1 torch thread; torch {torch.__version__}, Python "
        f"{platform.python_version()}; load {load:.1f} at the start; {time.perf_counter() - t0:.0f} s in all\n"
    )
    lines = table(rows, ops)
    print("\n".join(lines))
    return 1 if any(line.endswith("| NO |") for line in lines) else 0


if __name__ == "__main__":
    sys.exit(main())
