"""The executor's host time per graph op (issue 30, item 1): a deep, narrow GPT-2 whose every op computes in a few
microseconds, so a training step's time is almost all Python and dispatch, trained on the CPU by eager PyTorch, by
`xsched.wrap` of the eager plan on one device, and by the param-offload path `xsched train --param-home cpu:1
--store cpu:1` runs (cpu:0 computes, cpu:1 holds the parameters, gradients and AdamW state, a `park` plan at a
budget below the parameters' bytes, so weights are copied in and gradients out every step; host AdamW beside it),
and that session again with its executor on lanes, a thread per stream, as a GPU runs it (on logical CPUs the steps
run inline in the training thread by default): there the training thread's CPU time is what issuing the steps costs.

    python scripts/bench_host_overhead.py                    # 48 layers, n_embd 64, seq 16, batch 1: ~2,000 ops
    python scripts/bench_host_overhead.py --layers 2 --steps 3 --budget 1MiB   # the test's tiny size
    python scripts/bench_host_overhead.py --rows lanes --switch-intervals 0.001,0.0002   # the GIL's share (issue 30)

Every row trains the same initial weights on the same batches with AdamW (lr 1e-3, weight decay 0.01 on 2+-D
weights) on one torch thread, in this one process (eager and wrap with their steps interleaved). After `--warmup`
steps, each row reports per step and per op of the training graph (forward and backward), each with its ratio to
eager's: the median and best wall time; the median CPU time of the training thread (time.thread_time: the Python
and dispatch of the step, whatever else loads the machine; on lanes, what issuing the tasks costs); and the median
CPU time of the whole process (every thread: the lanes', the host AdamW's). The lanes row adds its lanes' own
figures from the step breakdown (xsched.execute.step_clock), per op: the compute lane thread's CPU inside its tasks
(`compute_issue_cpu_s`: its Python and dispatch, plus the kernels on a CPU; on a GPU the host cost of issuing them),
the wall time inside them (`compute_issue_s`, what a GPU run's breakdown calls the host time issuing the compute) and
the difference, waiting (for the GIL: a thread that releases it for a torch call takes it back behind whoever holds
it; or for the machine); the copy lanes' CPU / wall a step; the tasks a step the compute lane runs of all the lanes';
its thread's context switches a step (each wait for another lane, or for the GIL, is one; in brackets those the
machine forced) and its run-queue wait a step (ready, no core free: the machine's share of the waiting), these three
from the step breakdown (Linux's /proc). `--switch-intervals` adds a lanes row per GIL switch interval
(sys.setswitchinterval, set for its steps and restored), the steps of all lanes rows
interleaved in one session, so the load weighs on each alike (one training run: their losses are its losses).
The offload rows' setup (capture, model costs, `park`) is cached in `--cache-dir` when given; `--json` keeps every
row's per-step figures.
"""

from __future__ import annotations

import argparse
import contextlib
import json
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


def offload_setup(a: argparse.Namespace, steps: int, cache: str, method: str, time_limit: float) -> dict[str, Any]:
    """The offload rows' setup (xsched_run's): the narrow GPT-2 of `a` (`scale_of`) at `a.budget` on cpu:0, its
    parameters, gradients and AdamW on cpu:1 (a 1 GiB host budget), modelled costs, plans cached in `cache`."""
    return {
        "scale": scale_of(a),
        "steps": steps,
        "cpu": True,
        "device": "cpu:0",
        "store": "cpu:1",
        "host_budget": "1GiB",
        "budget": a.budget,
        "method": method,
        "time_limit": time_limit,
        "profile": "model",
        "cache_dir": cache,
    }


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


def lanes_session(setup: dict[str, Any], **options: Any) -> tuple[Any, Any]:
    """`xsched train`'s session of the offload row (its own setup and step function; its plan from the cache the
    offload row filled; `options` over its TrainConfig), its executor run on its lanes, a thread per stream, as on a
    GPU (`overlap`: on logical CPUs the steps run inline by default); the session and its world."""
    from xsched.train import dist
    from xsched.train.records import Quiet
    from xsched.train.session import placement, prepare

    config = offload_config(setup, "gpt2", setup["scale"], setup["budget"], **options)
    config.check()
    budgets, devices = placement(config, 0)
    world = dist.join(use_cuda=False)
    session, _ = prepare(config, budgets, devices, world, Quiet())
    session.wrapped._first.executor.overlap = True
    return session, world


def row_lanes(setup: dict[str, Any], intervals: list[float | None]) -> dict[str, dict[str, Any]]:
    """The offload row's session (`xsched train`'s own setup and step function, its plan from the cache the offload
    row filled), its executor run on its lanes, a thread per stream, as on a GPU (`overlap`: on logical CPUs the
    steps run inline by default). The training thread then only issues the tasks: its CPU time is the issue cost.
    One row per GIL switch interval of `intervals` (None: the interpreter's as it is), their steps interleaved
    (step s under interval s mod len), so the machine's load weighs on each alike; every row gets `--steps` steps."""
    from xsched.contracts.plan import Copy
    from xsched.train import dist
    from xsched.train.loop import _step

    session, world = lanes_session(setup)
    ex = session.wrapped._first.executor
    copies = sum(isinstance(x, Copy) for x in session.chosen.plan.steps)
    outs = {
        lanes_row(v): {"step_s": [], "cpu_s": [], "process_s": [], "losses": [], "copies": copies} for v in intervals
    }
    for out in outs.values():
        out.update({k: [] for k in BREAKDOWN})
    compute = ex.lanes[f"compute:{setup['device']}"]
    before = sys.getswitchinterval()
    losses: list[float] = []  # one session: the rows' steps are one training run, its losses compared with eager's
    try:
        for s in range(setup["steps"] * len(intervals)):
            v = intervals[s % len(intervals)]
            out = outs[lanes_row(v)]
            sys.setswitchinterval(before if v is None else v)
            try:
                t0, c0, p0 = time.perf_counter(), time.thread_time(), time.process_time()
                record = _step(session, s, world, 1)
                out["cpu_s"].append(time.thread_time() - c0)
                out["process_s"].append(time.process_time() - p0)
                out["step_s"].append(time.perf_counter() - t0)
            finally:
                sys.setswitchinterval(before)
            losses.append(record.loss)
            for k in BREAKDOWN:
                out[k].append(record.breakdown.get(k, float("nan")))  # the scheduler's counts: Linux only
        for out in outs.values():
            out["tasks"] = lane_tasks(ex, compute)
            out["losses"] = losses[: setup["steps"]]
    finally:
        session.updater.close()
        dist.leave(world)
    return outs


def lanes_row(interval: float | None) -> str:
    """The lanes row's name under a GIL switch interval (None: as the interpreter has it)."""
    return "lanes" if interval is None else f"lanes, switch interval {interval * 1e3:g} ms"


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
    arithmetic: to LOSS_RTOL), and on lanes (medians a step) the compute lane's tasks' thread CPU and wall per op
    (the step breakdown's compute_issue_cpu_s and compute_issue_s: wall less CPU is waiting, for the GIL or another
    lane), the copy lanes' CPU / wall, the tasks a step and the compute lane thread's context switches."""
    lines = [
        "| row | steps | wall: median step | per op | vs eager | best step | per op | vs eager "
        "| thread CPU: median step | per op | vs eager | process CPU: median step | per op | vs eager "
        "| losses = eager | copies a step | compute lane: thread CPU per op | its tasks' wall per op "
        "| waiting per op (wall - CPU) | copies in: CPU / wall | copies out: CPU / wall "
        "| tasks a step: compute lane / all | its context switches a step (preempted) | its run-queue wait a step |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
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
        lane = lane_cells(r, ops, warmup)
        tasks = "{} / {}".format(*r["tasks"]) if "tasks" in r else "-"
        switches = (
            f"{statistics.median(r['compute_switches'][warmup:]):.0f} "
            f"({statistics.median(r['compute_preempted'][warmup:]):.0f})"
            if "compute_switches" in r
            else "-"
        )
        ready = f"{statistics.median(r['compute_ready_s'][warmup:]) * 1e3:.1f} ms" if "compute_ready_s" in r else "-"
        label = LABELS.get(row) or f"{LABELS['lanes']}, GIL {row.removeprefix('lanes, ')}"
        lines.append(
            f"| {label} | {kept} | {' | '.join(cells)} | {same} | {r.get('copies', 0)} | {' | '.join(lane)} "
            f"| {tasks} | {switches} | {ready} |"
        )
    return lines


def lane_cells(r: dict[str, Any], ops: int, warmup: int) -> list[str]:
    """The lanes rows' compute lane CPU, wall and waiting per op and the copy lanes' CPU / wall a step (medians);
    five "-" for the rows without lanes."""
    if "compute_issue_s" not in r:
        return ["-"] * 5

    def med(key: str) -> float:
        return statistics.median(r[key][warmup:])

    cpu, wall = med("compute_issue_cpu_s"), med("compute_issue_s")
    wait = statistics.median(w - c for w, c in zip(r["compute_issue_s"][warmup:], r["compute_issue_cpu_s"][warmup:]))
    out = [f"{cpu / ops * 1e6:.1f} us", f"{wall / ops * 1e6:.1f} us", f"{wait / ops * 1e6:.1f} us"]
    for kind in ("copy_in", "copy_out"):
        out.append(f"{med(f'{kind}_issue_cpu_s') * 1e3:.1f} / {med(f'{kind}_issue_s') * 1e3:.1f} ms")
    return out


BREAKDOWN = tuple(  # what the lanes rows keep of each step's breakdown (xsched.execute.step_clock)
    f"{kind}_{what}" for kind in ("compute", "copy_in", "copy_out") for what in ("issue_s", "issue_cpu_s", "tasks")
) + ("compute_switches", "compute_preempted", "compute_ready_s", "optimizer_s", "optimizer_wait_read_s")
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
    ap.add_argument(
        "--switch-intervals",
        default="",
        help="comma-separated GIL switch intervals in seconds (sys.setswitchinterval), each a lanes row of its own, "
        "their steps interleaved with the lanes row's as it is (e.g. 0.0005,0.0002)",
    )
    ap.add_argument("--json", help="write every row's per-step figures here")
    a = ap.parse_args(argv)
    rows = a.rows.split(",")
    unknown = [r for r in rows if r not in ROWS]
    try:
        intervals: list[float | None] = [None, *(float(x) for x in a.switch_intervals.split(",") if x)]
    except ValueError:
        intervals = []
    if (
        unknown
        or a.steps <= a.warmup
        or a.warmup < 0
        or not intervals
        or any(v is not None and v <= 0 for v in intervals)
    ):
        why = (
            f"unknown rows {unknown}"
            if unknown
            else "--steps must exceed --warmup >= 0"
            if a.steps <= a.warmup or a.warmup < 0
            else f"--switch-intervals must be positive seconds, not {a.switch_intervals!r}"
        )
        print(f"bench_host_overhead: {why}", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    with contextlib.ExitStack() as stack:
        cache = a.cache_dir or stack.enter_context(tempfile.TemporaryDirectory())
        setup = offload_setup(a, a.steps, cache, a.method, a.time_limit)
        ops = graph_ops(setup)
        r0 = time.perf_counter()
        results = eager_and_wrap(setup, [r for r in ("eager", "wrap") if r in rows])
        if "offload" in rows or "lanes" in rows:
            offload = row_offload(setup)  # plans (or finds the plan in the cache) for the lanes row too
            if "offload" in rows:
                results["offload"] = offload
        if "lanes" in rows:
            results.update(row_lanes(setup, intervals))
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
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"command": cmd, "ops": ops, "warmup": a.warmup, "rows": results}, f)
    return 1 if any("| NO (" in line for line in lines) else 0  # an xsched row's losses differ from eager's


if __name__ == "__main__":
    sys.exit(main())
