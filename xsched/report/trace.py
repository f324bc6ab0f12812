"""Chrome-trace JSON of a plan (opens in Perfetto or chrome://tracing): one complete event per executed step, one
thread per lane, either predicted (the simulator's overlapped model) or measured (one run of the executor, every
step timed: host clock on CPU lanes, CUDA events on GPU streams).

Tracing builds its own executor with timed step functions (Executor's `table`), so the executor's hot path is
untouched when nobody traces; the traced run goes step by step (no generated inline programs), so its steps
show the per-step path's cost, a microsecond or so more than a fused run.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from xsched.contracts.graph import Graph
from xsched.contracts.plan import Compute, Copy, Free, Plan, Step
from xsched.contracts.profile import Profile
from xsched.execute.executor import Executor
from xsched.execute.steps import StepFn, prepare_compute, prepare_copy, prepare_free
from xsched.lanes import lane_of
from xsched.simulate import simulate

PID = 1


def step_name(graph: Graph, step: Step) -> str:
    if isinstance(step, Compute):
        op = graph.op[step.op]
        return op.name or op.target
    if isinstance(step, Copy):
        return f"copy {step.value}"
    return f"free {step.value}"


def step_args(graph: Graph, i: int, step: Step) -> dict[str, Any]:
    if isinstance(step, Compute):
        op = graph.op[step.op]
        return {"step": i, "op": op.id, "target": op.target, "phase": op.phase, "device": step.device}
    if isinstance(step, Copy):
        return {
            "step": i,
            "value": step.value,
            "src": step.src,
            "dst": step.dst,
            "bytes": graph.value[step.value].nbytes,
        }
    return {"step": i, "value": step.value, "device": step.device}


def chrome_trace(
    graph: Graph,
    plan: Plan,
    spans: Sequence[tuple[float, float]],
    lanes: Sequence[str],
    title: str,
    args: Mapping[int, Mapping[str, Any]] | None = None,
    meta: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The trace: an "X" event per step at its (start, end) seconds on its lane's thread (named by metadata
    events, lanes sorted by device), `args` added to each step's own."""
    order = sorted(dict.fromkeys(lanes), key=lambda k: (k.split(":", 1)[1], k))
    tid = {k: n + 1 for n, k in enumerate(order)}
    events: list[dict[str, Any]] = [{"ph": "M", "pid": PID, "name": "process_name", "args": {"name": title}}]
    for k, n in tid.items():
        events.append({"ph": "M", "pid": PID, "tid": n, "name": "thread_name", "args": {"name": k}})
        events.append({"ph": "M", "pid": PID, "tid": n, "name": "thread_sort_index", "args": {"sort_index": n}})
    for i, (step, (a, b), lane) in enumerate(zip(plan.steps, spans, lanes, strict=True)):
        kind = type(step).__name__.lower()
        events.append(
            {
                "ph": "X",
                "pid": PID,
                "tid": tid[lane],
                "name": step_name(graph, step),
                "cat": kind,
                "ts": a * 1e6,
                "dur": max(b - a, 0.0) * 1e6,
                "args": {**step_args(graph, i, step), **dict((args or {}).get(i, {}))},
            }
        )
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"graph": graph.name, **dict(meta or {})}}


def predicted_trace(graph: Graph, plan: Plan, profile: Profile) -> dict[str, Any]:
    """The plan's steps at the simulator's overlapped (start, end), on the lanes of xsched.lanes."""
    r = simulate(graph, plan, profile, check_budgets=False)
    lanes = [lane_of(s) for s in plan.steps]
    meta = {"source": "predicted: xsched.simulate overlapped model", "makespan_s": r.makespan_s, "time_s": r.time_s}
    return chrome_trace(graph, plan, r.step_span, lanes, f"{graph.name}: predicted", meta=meta)


class _Recorder:
    """What each timed step saw: host (start, end) or its CUDA events, and the thread that ran it."""

    def __init__(self) -> None:
        self.host: dict[int, tuple[float, float]] = {}
        self.cuda: dict[int, tuple[Any, Any, torch.device]] = {}
        self.thread: dict[int, str] = {}

    def clear(self) -> None:
        self.host.clear()
        self.cuda.clear()
        self.thread.clear()

    def timed(self, prepare: Callable[[Executor, int, Any], StepFn]) -> Callable[[Executor, int, Any], StepFn]:
        def make(ex: Executor, i: int, s: Step) -> StepFn:
            fn = prepare(ex, i, s)
            gpu = _gpu_of(ex, s)
            if gpu is None:

                def host_step(st: Any) -> None:
                    t0 = time.perf_counter()
                    fn(st)
                    self.host[i] = (t0, time.perf_counter())
                    self.thread[i] = threading.current_thread().name

                return host_step

            def cuda_step(st: Any) -> None:
                stream = torch.cuda.current_stream(gpu)  # the lane's stream (lane threads set it) or the caller's
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record(stream)
                fn(st)
                b.record(stream)
                self.cuda[i] = (a, b, gpu)
                self.thread[i] = threading.current_thread().name

            return cuda_step

        return make


def _gpu_of(ex: Executor, s: Step) -> torch.device | None:
    """The GPU whose stream runs the step's work (a copy's GPU end), or None for host work and frees."""
    if isinstance(s, Compute):
        devs = [ex.dev[s.device]]
    elif isinstance(s, Copy):
        devs = [ex.dev[s.src], ex.dev[s.dst]]
    else:
        return None
    return next((d for d in devs if d.type == "cuda"), None)


def measured_trace(
    graph: Graph,
    plan: Plan,
    env: Mapping[str, torch.Tensor],
    devices: Mapping[str, torch.device | str] | None = None,
    *,
    overlap: bool | None = None,
    warmup: int = 1,
) -> dict[str, Any]:
    """Run the whole plan `warmup` + 1 times with every step timed; the last run as a trace (seconds from its
    start), each step on the executor's lane for it, args naming the thread that ran it."""
    rec = _Recorder()
    table = {Compute: rec.timed(prepare_compute), Copy: rec.timed(prepare_copy), Free: rec.timed(prepare_free)}
    ex = Executor(graph, plan, devices, check=False, table=table, overlap=overlap)
    try:
        for _ in range(warmup):
            ex(env)
        gpus = {d for d in ex.dev.values() if d.type == "cuda"}
        for g in gpus:
            torch.cuda.synchronize(g)
        rec.clear()
        refs = {g: torch.cuda.Event(enable_timing=True) for g in gpus}
        for g, ev in refs.items():
            ev.record(torch.cuda.current_stream(g))
        t0 = time.perf_counter()
        st = ex.start(env)
        ex.run(st)
        for g in gpus:
            torch.cuda.synchronize(g)
        wall = time.perf_counter() - t0
    finally:
        ex.close()
    spans = []
    for i in range(len(plan.steps)):
        if i in rec.cuda:
            a, b, g = rec.cuda[i]
            spans.append((refs[g].elapsed_time(a) / 1e3, refs[g].elapsed_time(b) / 1e3))
        else:
            h0, h1 = rec.host[i]
            spans.append((h0 - t0, h1 - t0))
    args = {i: {"thread": rec.thread.get(i, "")} for i in range(len(plan.steps))}
    meta = {
        "source": "measured: one run of the executor, each step timed",
        "wall_s": wall,
        "overlap": ex.overlap,
        "devices": {d: str(t) for d, t in ex.dev.items()},
    }
    return chrome_trace(graph, plan, spans, ex.lane_of, f"{graph.name}: measured", args, meta)


def write_trace(trace: Mapping[str, Any], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(trace, separators=(",", ":")) + "\n")
    return path
