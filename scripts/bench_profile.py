"""Profile fidelity: the sum of profiled CPU op times of the eager plan vs a measured eager PyTorch training step.

For each zoo model: capture the training graph, profile it on each CPU device, predict the eager plan's
sequential time from the profile (xsched.simulate), and time the real thing: forward + torch.autograd.grad of
the outputs (ones as tangents, as the captured graph's tangent inputs) w.r.t. the parameters, at the same
thread count, median of --iters steps after warm-up. Prints a table; --write also writes docs/bench/profile.md.

    python scripts/bench_profile.py --scale default --devices cpu:threads=1,clock=thread,cpu --write

A device with clock=thread is compared with the eager step's CPU time (this thread's), any other with its wall time.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from xsched import zoo
from xsched.capture.torch import bind_inputs, capture
from xsched.contracts import torch_ops as ops
from xsched.contracts.graph import Graph
from xsched.devices import Policy, get_device
from xsched.devices.base import split_device_list
from xsched.devices.cpu import cpu_model, torch_threads
from xsched.profiling.measure import profile_graph
from xsched.simulate import simulate
from xsched.solve.reference import eager_plan

OUT = Path(__file__).resolve().parents[1] / "docs" / "bench" / "profile.md"
NOTES = """\
Columns: *sum of profiled op times* is the eager plan's sequential time predicted from the profile
(`simulate(graph, eager_plan(graph, device), profile).time_s`: every op once, each at its profiled median);
*eager step* is one real PyTorch training step (forward, then `torch.autograd.grad` of the outputs with ones as
tangents w.r.t. the parameters), median of the iterations; *op-by-op replay* runs the captured graph's ops in
order with `xsched.contracts.torch_ops.run_op` (no autograd), which separates profiling error from eager PyTorch's own overhead.
*ratio* = predicted / measured. A `clock=thread` device is timed by the measuring thread's CPU time and compared
with the eager step's CPU time; any other device by wall time. The CPU time is what the work costs on a core of
its own: on a machine whose cores other jobs share, wall times include the time slices given to those jobs (the
last column shows how much), and multi-threaded wall timings suffer worst (an OpenMP barrier waits for a
descheduled thread), so only a quiet machine gives meaningful `cpu` (all threads, wall clock) rows.
"""


def eager_step_seconds(model: torch.nn.Module, inputs: tuple, threads: int | None, iters: int) -> tuple[float, float]:
    """Median wall time and median CPU time of one eager training step (forward + gradients of the parameters).

    CPU time (this thread's) is what the step costs when other jobs share the cores; it is what a clock=thread
    profile (one intra-op thread) is compared with."""
    params = [p for p in model.parameters() if p.requires_grad]

    def step() -> None:
        out = model(*inputs)
        leaves = [o for o in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(o, torch.Tensor)]
        leaves = [o for o in leaves if o.requires_grad]
        torch.autograd.grad(leaves, params, [torch.ones_like(o) for o in leaves], allow_unused=True)

    with torch_threads(threads):
        return _timed(step, iters)


def replay_seconds(
    graph: Graph, model: torch.nn.Module, inputs: tuple, threads: int | None, iters: int
) -> tuple[float, float]:
    """Median wall and CPU time of running the captured graph op by op (xsched.contracts.torch_ops.run_op, graph order, no autograd)."""
    env = bind_inputs(graph, model, inputs)

    def step() -> None:
        values = dict(env)
        for op in graph.ops:
            values.update(zip(op.outputs, ops.run_op(op, values, "cpu")))

    with torch_threads(threads), torch.no_grad():
        return _timed(step, iters)


def _timed(step: Callable[[], None], iters: int) -> tuple[float, float]:
    for _ in range(2):
        step()
    wall, cpu = [], []
    for _ in range(iters):
        t0, c0 = time.perf_counter(), time.thread_time()
        step()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.thread_time() - c0)
    return statistics.median(wall), statistics.median(cpu)


def run(models: list[str], scale: str, devices: list[str], iters: int, max_total_s: float | None) -> list[dict]:
    rows = []
    for name in models:
        z = zoo.build(name, scale=scale)
        g = capture(z.model, z.inputs, name=f"{name}-{scale}")
        for dev in devices:
            t0 = time.perf_counter()
            p = profile_graph(g, [dev], policy=Policy(), max_total_s=max_total_s, progress=False)
            wall = time.perf_counter() - t0
            predicted = simulate(g, eager_plan(g, dev), p).time_s
            assert predicted is not None
            d = get_device(dev)
            wall_s, cpu_s = eager_step_seconds(z.model, z.inputs, d.threads, iters)  # type: ignore[attr-defined]
            by_cpu_time = getattr(d, "clock", "wall") == "thread"  # compare like with like
            measured = cpu_s if by_cpu_time else wall_s
            replay = replay_seconds(g, z.model, z.inputs, d.threads, iters)[1 if by_cpu_time else 0]  # type: ignore[attr-defined]
            row = {
                "model": name,
                "ops": len(g.ops),
                "distinct": p.profiling["signatures"],
                "device": dev,
                "profile_s": wall,
                "predicted_ms": predicted * 1e3,
                "measured_ms": measured * 1e3,
                "clock": "CPU time" if by_cpu_time else "wall",
                "ratio": predicted / measured,
                "replay_ms": replay * 1e3,
                "replay_ratio": predicted / replay,
                "wall_ms": wall_s * 1e3,
            }
            rows.append(row)
            print(_line(row), flush=True)
    return rows


HEADER = (
    "| model | ops | distinct | device | profiling wall s | sum of profiled op times ms | eager step ms | clock "
    "| ratio | op-by-op replay ms | ratio to replay | eager step wall ms |"
)
RULE = "|---|---|---|---|---|---|---|---|---|---|---|---|"


def _line(r: dict) -> str:
    return (
        f"| {r['model']} | {r['ops']} | {r['distinct']} | {r['device']} | {r['profile_s']:.1f} | "
        f"{r['predicted_ms']:.2f} | {r['measured_ms']:.2f} | {r['clock']} | {r['ratio']:.3f} | "
        f"{r['replay_ms']:.2f} | {r['replay_ratio']:.3f} | {r['wall_ms']:.2f} |"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(zoo.names()))
    ap.add_argument("--scale", default="default")
    ap.add_argument("--devices", default="cpu:threads=1,clock=thread,cpu:threads=1,cpu")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--max-total-s", type=float, default=None, help="per profile: after this, the quick policy")
    ap.add_argument("--write", action="store_true", help=f"write the table to {OUT.relative_to(OUT.parents[2])}")
    a = ap.parse_args(argv)
    print(HEADER + "\n" + RULE)
    rows = run(a.models.split(","), a.scale, split_device_list(a.devices), a.iters, a.max_total_s)
    summary = ""
    for dev in split_device_list(a.devices):
        ratios = [r["ratio"] for r in rows if r["device"] == dev]
        within = sum(abs(x - 1) <= 0.15 for x in ratios)
        summary += f"{dev}: {within}/{len(ratios)} within 15%, median ratio {statistics.median(ratios):.3f}.  \n"
    print(summary)
    if a.write:
        cmd = "python scripts/bench_profile.py " + " ".join(sys.argv[1:] if argv is None else argv)
        machine = (
            f"{cpu_model()['brand']}, {os.cpu_count()} logical cores (shared with other jobs while measured), "
            f"torch {torch.__version__}, Python {platform.python_version()}"
        )
        body = "\n".join(_line(r) for r in rows)
        OUT.parent.mkdir(parents=True, exist_ok=True)
        OUT.write_text(
            f"## Profile fidelity (scale {a.scale})\n\nCommand: `{cmd}`  \nMachine: {machine}\n\n"
            f"{HEADER}\n{RULE}\n{body}\n\n{summary}\n\n{NOTES}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
