"""The report of scripts/bench_offload.py: its header, the notes on each part's setup and columns, and its tables."""

from __future__ import annotations

import argparse
import os
import platform
import time
from collections.abc import Mapping, Sequence

import torch

NOTES_A = """\
Setup. Op costs are measured once on "cpu:threads=1" (`profile_calibrated`: interleaved sweeps, median of 3 rounds,
then calibrated by the eager step run back to back) and given to cpu:0; cpu:1 gets no op costs, so it can only store
(else the offload search could move the whole step onto cpu:1, which has the room). The link is the latency + bandwidth fit of the CPU plugin's memcpy timing into a
preallocated tensor (the executor's copy is a clone, which also allocates). Every graph input (params, data,
tangents) is homed on cpu:0 in every plan; offload never parks graph inputs. Budgets: cpu:0 at the given share of
`eager_peak(graph)` for both methods, cpu:1 at 100% for offload; where neither method fits, the next 5% step up
where either does (said in the budget column).

Columns. predicted: the simulator with that profile; `vs eager (predicted)`: makespan over the eager plan's.
`copy time hidden` = 1 - (makespan - makespan of the same plan with every copy costing zero) / total copy time
(the copy steps' spans in `SimResult.step_span`). `measured step`: `Executor(graph, plan)` start + run (no autograd
wrapper), 1 torch thread, median of {iters} rounds after 2 warm-up rounds, the plans' order rotating each round;
`vs eager`: ratio of medians to the eager plan's. The executor's default on logical CPUs runs every step in plan
order in the calling thread. `on lanes`: the same plans with `Executor(..., overlap=True)`, a thread per stream
and copies overlapping compute, as a ratio to the eager plan run the same way (a one-device plan without copies
runs inline either way). `eager + 1 copy (lanes control)`: the eager plan plus one copy of the smallest graph
output to cpu:1 at the end, so that on lanes every step runs on a thread: the cost of the lanes alone. Peaks: the simulator's / the
executor's resident-byte accounting (params and inputs included), the largest over the measured rounds."""

NOTES_B = """\
Setup. Op costs: the roofline model of {gpu} (`profile_graph`); "cpu" gets no op costs (store only). Links: the
fit of the sim plugin's modelled copy times over the spec's host link (pinned memory). Every graph input is homed on
the GPU; budgets as in part A (the GPU at the given share of the eager peak, the cpu store at 100%). Columns as in
part A: `vs eager` is predicted makespan over the eager plan's, `copy time hidden` the same formula."""

HEAD_A = (
    "| model | cpu:0 budget (of eager peak) | plan | parked | recomputed ops | prefetch (ops) | predicted seq "
    "| predicted makespan | vs eager (predicted) | copy time hidden (predicted) | measured step | vs eager (measured) "
    "| on lanes, vs eager on lanes (measured) | peak cpu:0 sim / executor | peak cpu:1 sim / executor |"
)
HEAD_F = (
    "| model | method | smallest cpu:0 budget | parked | recomputed ops | predicted makespan vs eager "
    "| peak on the store |"
)
HEAD_B = (
    "| model | GPU budget (of eager peak) | plan | parked | recomputed ops | prefetch (ops) | predicted makespan "
    "| vs eager | total copy time | copy time hidden |"
)


def table(head: str, rows: Sequence[str]) -> list[str]:
    """A markdown table: the header line, its rule, then the rows."""
    return [head, "|" + "---|" * (head.count("|") - 1), *rows]


def report(
    args: argparse.Namespace, part: Mapping[str, list[str]], notes: Sequence[str], cmd: str, start: str, load: float
) -> str:
    """The markdown report: command, span (from `start` to now, UTC), machine, then part A's tables (when it ran)
    and part B's."""
    out = [
        "# Offload benchmark: parking activations on a second device vs recomputation",
        "",
        f"Command: `{cmd}` ({start}-{time.strftime('%H:%M', time.gmtime())} UTC)  ",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores shared with other jobs (load average {load:.1f} at the "
        f"start), torch {torch.__version__}, 1 torch thread for profiling and runs.",
    ]
    if part["a"]:
        out += ["", "## Part A: measured, two logical CPU devices (cpu:0 computes, cpu:1 stores)", ""]
        out += [NOTES_A.format(iters=args.iters), "", "Link cpu:0<->cpu:1 both ways: " + "; ".join(notes), ""]
        out += table(HEAD_A, part["a"])
        out += [
            "",
            "### How far each method reaches on cpu:0 (from 50% down in 5% steps, the last budget that fits)",
            "",
        ]
        out += table(HEAD_F, part["floors"])
    out += ["", f"## Part B: predicted only, {args.gpu} computes, the real cpu stores over the spec's host link", ""]
    out += [
        "THESE ARE MODEL PREDICTIONS (the simulator with the roofline profile of the simulated GPU), NOT "
        "MEASUREMENTS: no GPU ran.",
        "",
        NOTES_B.format(gpu=args.gpu),
        "",
    ]
    out += table(HEAD_B, part["b"])
    return "\n".join(out)
