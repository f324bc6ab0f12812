"""The executor's host time per graph op (issue 30, item 1): a deep, narrow GPT-2 whose every op computes in a few
microseconds, so a training step's time is almost all Python and dispatch, trained on the CPU by eager PyTorch, by
`xsched.wrap` of the eager plan on one device, and by the param-offload path `xsched train --param-home cpu:1
--store cpu:1` runs (cpu:0 computes, cpu:1 holds the parameters, gradients and AdamW state, a `park` plan at a
budget below the parameters' bytes, so weights are copied in and gradients out every step; host AdamW beside it),
and that session again with its executor on lanes, a thread per stream, as a GPU runs it (on logical CPUs the steps
run inline in the training thread by default): there the training thread's CPU time is what issuing the steps costs.

    python scripts/bench_host_overhead.py                    # 48 layers, n_embd 64, seq 16, batch 1: ~2,000 ops
    python scripts/bench_host_overhead.py --layers 2 --steps 3 --budget 1MiB   # the test's tiny size

Every row trains the same initial weights on the same batches with AdamW (lr 1e-3, weight decay 0.01 on 2+-D
weights) on one torch thread, in this one process (eager and wrap with their steps interleaved). After `--warmup`
steps, each row reports per step and per op of the training graph (forward and backward), each with its ratio to
eager's: the median and best wall time; the median CPU time of the training thread (time.thread_time: the Python
and dispatch of the step, whatever else loads the machine; on lanes, what issuing the tasks costs); and the median
CPU time of the whole process (every thread: the lanes', the host AdamW's). The lanes row adds its compute lane's
own figures, per op: the lane thread's CPU time (its Python and dispatch, plus the kernels on a CPU; on a GPU the
host cost of issuing them) and the wall time inside its tasks (the step breakdown's `compute_issue_s`, what a GPU
run's breakdown calls the host time issuing the compute: CPU plus waiting for the GIL), the tasks a step it runs
of all the lanes', and its thread's context switches a step (each wait for another lane, or for the GIL, is one).
The offload rows' setup (capture, model costs, `park`) is cached in `--cache-dir` when given.
"""

from __future__ import annotations

import argparse
import contextlib
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
from bench_gpu_param_offload import LR, backward_with, groups, same_losses, task_of
from bench_param_offload_rows import offload_config, xsched_run

ROWS = ("eager", "wrap", "offload", "lanes")
LOSS_RTOL = 1e-4


def scale_of(a: argparse.Namespace) -> str:
    """The zoo gpt2 scale: `tiny` widened to the narrow, deep shape asked for (vocab 64, no dropout)."""
    return f"tiny:n_layer={a.layers},n_embd={a.embd},n_head=2,seq={a.seq},batch=1,dropout=0.0"


def graph_ops(setup: dict[str, Any]) -> int:
    """Ops in the training graph (forward and backward) of the task's model, as xsched captures it."""
    from xsched.capture.torch import capture

    task = task_of(setup)
    return len(capture(task.model, tuple(task.example_batch[0])).ops)


def one_step(task: Any, model: Any) -> Callable[[int], float]:
    """Training step `s` of `model` on the task's batch s, as the training loop makes it: forward, the loss,
    backward with the gradients set to None first, torch's AdamW step; returns the loss."""
    from xsched.train.loop import task_loss

    opt = torch.optim.AdamW(groups(model.parameters()), lr=LR)
    backward = backward_with(opt)

    def step(s: int) -> float:
        inputs, targets = task.batch(s)
        loss = task_loss(task, model(*inputs), targets)
        backward(loss)
        opt.step()
        return float(loss)

    return step


def eager_and_wrap(setup: dict[str, Any], rows: list[str]) -> dict[str, dict[str, Any]]:
    """The eager row (plain PyTorch) and the wrap row (`xsched.wrap` of the eager plan on one device, no budget
    pressure), each training its own copy of the same model; their steps interleaved, so the machine's load
    weighs on both alike."""
    from xsched.execute.wrap import wrap

    steps = {}
    for row in rows:
        task = task_of(setup)
        model = task.model
        if row == "wrap":
            model = wrap(model, tuple(task.example_batch[0]), {"cpu": "100%"}, method="eager", profile="model")
        steps[row] = one_step(task, model)
    out: dict[str, dict[str, Any]] = {row: {"step_s": [], "cpu_s": [], "process_s": [], "losses": []} for row in rows}
    for s in range(setup["steps"]):
        for row, step in steps.items():
            t0, c0, p0 = time.perf_counter(), time.thread_time(), time.process_time()
            loss = step(s)
            out[row]["cpu_s"].append(time.thread_time() - c0)
            out[row]["process_s"].append(time.process_time() - p0)
            out[row]["step_s"].append(time.perf_counter() - t0)
            out[row]["losses"].append(loss)
    return out


class ThreadCpu:
    """A train reporter that keeps each step's CPU time (between the reports): the training thread's
    (time.thread_time; the host optimizer's worker thread is not in it), what the step's own Python and dispatch
    cost whatever else shares the machine, and the whole process's (time.process_time, every thread)."""

    def __init__(self) -> None:
        self.steps: list[float] = []
        self.process: list[float] = []
        self._last = (0.0, 0.0)

    def start(self, info: Any) -> None:
        self._last = (time.thread_time(), time.process_time())

    def step(self, record: Any) -> None:
        now = (time.thread_time(), time.process_time())
        self.steps.append(now[0] - self._last[0])
        self.process.append(now[1] - self._last[1])
        self._last = now

    def checkpoint(self, step: int, path: Any) -> None: ...
    def notice(self, text: str) -> None: ...
    def end(self, result: Any) -> None: ...
    def close(self) -> None: ...


def row_lanes(setup: dict[str, Any]) -> dict[str, Any]:
    """The offload row's session (`xsched train`'s own setup and step function, its plan from the cache the offload
    row filled), its executor run on its lanes, a thread per stream, as on a GPU (`overlap`: on logical CPUs the
    steps run inline by default). The training thread then only issues the tasks: its CPU time is the issue cost."""
    from xsched.train import dist
    from xsched.train.loop import _step
    from xsched.train.records import Quiet
    from xsched.train.session import placement, prepare

    config = offload_config(setup, "gpt2", setup["scale"], setup["budget"])  # the offload row's: its cached plan
    config.check()
    budgets, devices = placement(config, 0)
    world = dist.join(use_cuda=False)
    session, _ = prepare(config, budgets, devices, world, Quiet())
    from xsched.contracts.plan import Copy

    ex = session.wrapped._first.executor
    ex.overlap = True
    copies = sum(isinstance(x, Copy) for x in session.chosen.plan.steps)
    out: dict[str, Any] = {"step_s": [], "cpu_s": [], "process_s": [], "losses": [], "copies": copies}
    out.update(lane_cpu_s=[], lane_issue_s=[], lane_switches=[])
    compute = ex.lanes[f"compute:{setup['device']}"]
    try:
        for s in range(setup["steps"]):
            t0, c0, p0, l0 = time.perf_counter(), time.thread_time(), time.process_time(), thread_cpu(compute)
            w0 = thread_switches(compute)
            record = _step(session, s, world, 1)
            out["cpu_s"].append(time.thread_time() - c0)
            out["process_s"].append(time.process_time() - p0)
            out["step_s"].append(time.perf_counter() - t0)
            out["losses"].append(record.loss)
            out["lane_cpu_s"].append(thread_cpu(compute) - l0)
            out["lane_issue_s"].append(record.breakdown["compute_issue_s"])
            out["lane_switches"].append(thread_switches(compute) - w0)
        out["tasks"] = lane_tasks(ex, compute)
    finally:
        session.updater.close()
        dist.leave(world)
    return out


def thread_cpu(lane: Any) -> float:
    """The CPU time so far of `lane`'s thread (0 before it starts), read from this thread: Linux's per-thread
    clocks (time.pthread_getcpuclockid); NaN where there are none."""
    ident = lane._thread.ident if lane._thread is not None else None
    if ident is None:
        return 0.0
    if not hasattr(time, "pthread_getcpuclockid"):
        return float("nan")
    return time.clock_gettime(time.pthread_getcpuclockid(ident))


def thread_switches(lane: Any) -> float:
    """The context switches so far of `lane`'s thread, voluntary (it waited: a hand-off) and not (0 before it
    starts), from Linux's /proc; NaN where there is none."""
    tid = lane._thread.native_id if lane._thread is not None else None
    if tid is None:
        return 0.0
    try:
        with open(f"/proc/self/task/{tid}/status") as f:
            return float(sum(int(line.split()[1]) for line in f if "ctxt_switches:" in line))
    except OSError:
        return float("nan")


def lane_tasks(ex: Any, lane: Any) -> tuple[int, int]:
    """Tasks a training step submits (every slice the executor ran on lanes): `lane`'s, and all lanes'."""
    plans = [tasks for _, tasks in ex.lane_runner._plans.values()]
    return sum(t[2] is lane for ts in plans for t in ts), sum(len(ts) for ts in plans)


def row_offload(setup: dict[str, Any]) -> dict[str, Any]:
    """`xsched train` with the parameters, gradients and AdamW on cpu:1 and a `park` plan on cpu:0."""
    from xsched.contracts.plan import Copy, Plan

    cpu = ThreadCpu()
    r, out = xsched_run(setup, "gpt2", setup["scale"], setup["budget"], reporter=cpu)
    out["cpu_s"], out["process_s"] = cpu.steps, cpu.process
    out["copies"] = sum(isinstance(s, Copy) for s in Plan.load(r.plan_path).steps)
    return out


LABELS = {
    "eager": "eager PyTorch (forward, backward, AdamW)",
    "wrap": "xsched.wrap, eager plan on cpu",
    "offload": "xsched train --param-home cpu:1 --store cpu:1, park on cpu:0, host AdamW",
    "lanes": "the same, its executor on lanes (a thread per stream, as on a GPU)",
}


def table(results: dict[str, dict[str, Any]], ops: int, warmup: int) -> list[str]:
    """One line per row: the median and best wall time of a step and the median CPU time of its training thread and
    of the whole process, per op, each with its ratio to eager's, whether its losses equal eager's (fp32, the same
    arithmetic: to LOSS_RTOL), and on lanes the compute lane's CPU and wall per op (medians), the tasks a step and the
    lane thread's context switches a step (median)."""
    lines = [
        "| row | steps | wall: median step | per op | vs eager | best step | per op | vs eager "
        "| thread CPU: median step | per op | vs eager | process CPU: median step | per op | vs eager "
        "| losses = eager | copies a step | compute lane: thread CPU per op | its tasks' wall per op "
        "| tasks a step: compute lane / all | its context switches a step |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    eager = results.get("eager")
    base = {k: f(eager[key][warmup:]) for k, key, f in FIGURES} if eager else {}
    for row, r in results.items():
        cells = []
        for k, key, f in FIGURES:
            x = f(r[key][warmup:])
            vs = f"{x / base[k]:.2f}x" if base else "-"
            cells.append(f"{x * 1e3:.1f} ms | {x / ops * 1e6:.1f} us | {vs}")
        same = "eager" if row == "eager" else same_losses(r["losses"], eager["losses"], LOSS_RTOL) if eager else "-"
        kept = len(r["step_s"]) - warmup
        lane = [f"{statistics.median(r[k][warmup:]) / ops * 1e6:.1f} us" if k in r else "-" for k in LANE]
        tasks = "{} / {}".format(*r["tasks"]) if "tasks" in r else "-"
        switches = f"{statistics.median(r['lane_switches'][warmup:]):.0f}" if "lane_switches" in r else "-"
        lines.append(
            f"| {LABELS[row]} | {kept} | {' | '.join(cells)} | {same} | {r.get('copies', 0)} | {' | '.join(lane)} "
            f"| {tasks} | {switches} |"
        )
    return lines


LANE = ("lane_cpu_s", "lane_issue_s")  # the lanes row's compute lane: its thread's CPU, the wall inside its tasks
FIGURES = (
    ("median", "step_s", statistics.median),
    ("best", "step_s", min),
    ("cpu", "cpu_s", statistics.median),
    ("process", "process_s", statistics.median),
)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--embd", type=int, default=64)
    ap.add_argument("--seq", type=int, default=16)
    ap.add_argument("--steps", type=int, default=20, help="steps per row, the warm-up included")
    ap.add_argument("--warmup", type=int, default=3, help="steps left out of the figures")
    ap.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, of {', '.join(ROWS)}")
    ap.add_argument("--budget", default="12MiB", help="cpu:0's budget in the offload row (parameters: 9.2 MiB)")
    ap.add_argument("--method", default="park", help="the offload row's solver method")
    ap.add_argument("--time-limit", type=float, default=60.0, help="the offload row's solver time limit, seconds")
    ap.add_argument("--cache-dir", help="keep the offload row's capture, costs and plan here (default: temporary)")
    a = ap.parse_args(argv)
    rows = a.rows.split(",")
    unknown = [r for r in rows if r not in ROWS]
    if unknown or a.steps <= a.warmup or a.warmup < 0:
        why = f"unknown rows {unknown}" if unknown else "--steps must exceed --warmup >= 0"
        print(f"bench_host_overhead: {why}", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    with contextlib.ExitStack() as stack:
        cache = a.cache_dir or stack.enter_context(tempfile.TemporaryDirectory())
        setup = {
            "scale": scale_of(a),
            "steps": a.steps,
            "cpu": True,
            "device": "cpu:0",
            "store": "cpu:1",
            "host_budget": "1GiB",
            "budget": a.budget,
            "method": a.method,
            "time_limit": a.time_limit,
            "profile": "model",
            "cache_dir": cache,
        }
        ops = graph_ops(setup)
        r0 = time.perf_counter()
        results = eager_and_wrap(setup, [r for r in ("eager", "wrap") if r in rows])
        if "offload" in rows or "lanes" in rows:
            offload = row_offload(setup)  # plans (or finds the plan in the cache) for the lanes row too
            if "offload" in rows:
                results["offload"] = offload
        if "lanes" in rows:
            results["lanes"] = row_lanes(setup)
        print(f"[rows: {time.perf_counter() - r0:.0f} s]", file=sys.stderr, flush=True)
    cmd = " ".join(["python scripts/bench_host_overhead.py", *(sys.argv[1:] if argv is None else argv)])
    print(f"# Host time per op: GPT-2 {setup['scale']}, {ops} ops a training step\n")
    print(f"Command: `{cmd}`  ")
    print(
        f"CPU, 1 thread; torch {torch.__version__}, Python {platform.python_version()}; "
        f"{time.perf_counter() - t0:.0f} s in all\n"
    )
    lines = table(results, ops, a.warmup)
    print("\n".join(lines))
    return 1 if any("| NO (" in line for line in lines) else 0  # an xsched row's losses differ from eager's


if __name__ == "__main__":
    sys.exit(main())
