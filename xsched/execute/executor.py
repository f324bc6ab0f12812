"""The multi-stream executor: runs a plan with one lane per stream of the simulator's overlapped model.

It generalises the reference interpreter (xsched.execute.reference) from one step at a time to one
thread per stream: each device has a compute lane, each ordered device pair a copy lane, and each
device a free lane. A step waits for exactly what `xsched.simulate._Clock` makes it wait for:
- compute of op o on d: the steps that made o's inputs resident on d, and every earlier free on d;
- copy of v from s to d: the step that made v resident on s, and every earlier free on d;
- free of v on d: the step that made v resident on d and every read of it since (computes and copies
  out), so no lane ever loses a tensor it still has to read (no use-after-free across streams), and the
  compute before it on d, so d allocates and frees in plan order and holds what the plan counts.
Allocations waiting for every earlier free on their device is what keeps the overlapped run within
the plan's memory; copies wait for nothing else, so they start as early as the plan allows (prefetch).
Random ops additionally run their first computes in plan order (the CPU generator is shared by the
lanes), so their draws match eager PyTorch; recomputations replay the state saved at the first run.
A slice of steps that touches one device and no copy has nothing to overlap: it runs inline in the
calling thread as one generated function (xsched.execute.program), about a call per op; on lanes, each compute-lane
task is such a function too.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from xsched.allocator import COPY_POOLS, DEFAULT_COPY_POOL
from xsched.contracts.graph import Graph
from xsched.contracts.holds import held_steps, releasable
from xsched.contracts.plan import Compute, Copy, Free, Plan, required_homes
from xsched.contracts.random_ops import random_ops
from xsched.errors import PlanError, XschedError
from xsched.execute.alloc_settings import use_expandable_segments
from xsched.execute.arena import ARENA_KINDS, Arena
from xsched.execute.compiled import reusable_inputs
from xsched.execute.held import poison_released, prepare_held
from xsched.execute.lane_run import LaneRunner
from xsched.execute.program import PreparedPlan, inline_program
from xsched.execute.reference import RunTrace, device_present
from xsched.execute.segments import Segments
from xsched.execute.steps import (
    STEP_KINDS,
    RunState,
    StepFn,
    prepare_compute,
    prepare_free,
    prepare_steps,
    tagged,
)
from xsched.execute.stores import DeviceStore
from xsched.execute.workers import Lane
from xsched.interpret import at_step
from xsched.lanes import ISSUE_MODES, inline_free_lanes, step_waits


class Executor:
    """Runs `plan` on real devices. `devices` maps plan devices to torch devices (default: "cuda:N" is
    that GPU, everything else, e.g. "cpu:0" and "cpu:1", is the CPU with its own store and lanes).

    `table` maps each step kind to a function (executor, index, step) -> StepFn; STEP_KINDS is the default.
    `watch`: values whose first computed tensor each run keeps in RunState.first, even if the plan frees it
    and recomputes it later (the wrapper writes buffer updates from there, once per iteration).
    `inplace`: run elementwise ops in place on an input the plan frees right after them (see
    compiled.reusable_inputs); the same numbers and the same byte accounting, fewer allocations.
    `overlap`: run a multi-device plan on its lanes (a thread per stream), overlapping them; default only when a
    plan device is a GPU. Logical CPU devices share the CPU and its thread pool, so there is nothing to gain,
    and the hand-offs between threads cost 6-20% of the step (docs/bench/offload.md): they run in plan order in
    the calling thread unless asked.
    `issue`: who issues an overlapped slice: "lanes" (default), a thread per lane; "one", the calling thread, every
    task in plan order onto its lane's stream with the lanes' waits, where every lane of the slice is a GPU stream or
    frees (no thread hand-offs; a host wait in a step, as for a weight's update, holds the rest back); else lanes.
    `copy_pool`: where a copy's destination on a GPU is allocated (xsched.allocator.COPY_POOLS): "side" (default),
    from its side stream's pool, which the compute stream cannot reuse; "compute", from the compute stream's pool,
    the side stream first waiting for every kernel queued on the compute stream (fewer reserved bytes; the wait may
    delay prefetches while the compute lane runs ahead).
    `expandable_segments`: turn on the CUDA caching allocator's expandable segments here, before the plan's first
    allocation (execute.alloc_settings; process-wide, for the segments made from now on; off by default, as no GPU
    run has measured it yet). `self.expandable_segments` says whether it was set: False on CPU devices, a no-op.
    `planned_addresses`: values the step makes live at planned offsets in one buffer per device (execute.arena,
    `self.arena`; in-place reuse off), so the device holds its homed inputs, the arena and what runs outside it;
    "whole": whole-step runs, nothing handed over at the autograd boundary: outputs are placed too, valid until the next run.
    """

    def __init__(
        self,
        graph: Graph,
        plan: Plan,
        devices: Mapping[str, torch.device | str] | None = None,
        *,
        check: bool = True,
        table: Mapping[type, Callable[[Executor, int, Any], StepFn]] | None = None,
        watch: frozenset[str] = frozenset(),
        inplace: bool = True,
        overlap: bool | None = None,
        compile: bool = False,
        copy_pool: str = DEFAULT_COPY_POOL,
        expandable_segments: bool = False,
        planned_addresses: bool | str = False,
        issue: str = "lanes",
    ) -> None:
        if issue not in ISSUE_MODES:
            raise XschedError(f"issue must be one of {', '.join(ISSUE_MODES)}, not {issue!r}", stage="execute")
        self.issue = issue
        if copy_pool not in COPY_POOLS:
            raise XschedError(f"copy_pool must be one of {', '.join(COPY_POOLS)}, not {copy_pool!r}", stage="execute")
        self.copy_pool = copy_pool
        if plan.graph != graph.fingerprint:
            raise PlanError(f"plan is for graph {plan.graph}, not {graph.fingerprint} ({graph.name})", stage="execute")
        self.graph = graph
        self.plan = plan
        self.names = plan.devices
        self.dev = {d: device_present(d, devices) for d in self.names}
        self.expandable_segments = expandable_segments and use_expandable_segments(self.dev.values())
        self.overlap = overlap if overlap is not None else any(t.type == "cuda" for t in self.dev.values())
        self.nbytes = {v.id: v.nbytes for v in graph.values}
        self.random = random_ops(graph)
        self.watch = watch
        self.must_end_on = required_homes(graph, plan.homes)
        self._homes = [
            (
                d,
                tuple(v for v in graph.inputs if plan.homes[v] == d and graph.value[v].kind != "tangent"),
                tuple(v for v in graph.inputs if plan.homes[v] == d and graph.value[v].kind == "tangent"),
            )
            for d in self.names
        ]
        steps = plan.steps
        # an output the caller holds is never overwritten in place, as a watched value is not: its free may be a
        # release (execute.held), which would empty the storage the in-place result was written into
        self.reuse = (
            reusable_inputs(graph, steps, watch | releasable(graph)) if inplace and not planned_addresses else {}
        )
        # the simulator's overlapped model, with the frees that wait only on their compute lane run on it
        self.lane_of = inline_free_lanes(graph, steps, self.random)
        self.deps = step_waits(graph, steps, self.random, self.lane_of)
        self.d2h = {i for i, s in enumerate(steps) if isinstance(s, Copy) and self.dev[s.src].type == "cuda"}
        self.lanes = {k: self._make_lane(k) for k in dict.fromkeys(self.lane_of)}
        self._finalizer = weakref.finalize(self, _close, list(self.lanes.values()))
        counts: dict[str, int] = {}
        for s in steps:
            if isinstance(s, Compute):
                counts[s.op] = counts.get(s.op, 0) + 1
        self.recomputed = tuple(o for o, n in counts.items() if n > 1)
        self.recomputed_random = self.random & frozenset(self.recomputed)  # only these need their RNG state saved
        whole = planned_addresses == "whole"
        self.arena = Arena(graph, plan, self.dev, watch, handed=not whole) if planned_addresses else None
        kinds = {**STEP_KINDS, **(ARENA_KINDS if self.arena else {}), **(table or {})}
        self.fns: list[StepFn] = prepare_steps(self, kinds, check)
        # releases and refills of outputs the caller holds, run alone outside generated programs (execute.held). A
        # whole-step run hands nothing over midway, so no caller holds them there: its frees and makes are plain.
        # Planned addresses place no residency of theirs (live across the boundary, or to the end: placement._fits)
        self.held = {} if whole else held_steps(graph, plan)
        for i, (kind, _) in self.held.items():
            self.fns[i] = tagged(prepare_held(self, i, kind, steps[i]), i, steps[i])
        # inline slices and compute lanes run generated programs, unless a custom step kind must see its steps
        self.generate = kinds[Compute] is prepare_compute and kinds[Free] is prepare_free
        self.prepared = PreparedPlan(
            graph, plan, dict(self.dev), self.nbytes, self.random, self.recomputed_random, dict(self.reuse), watch
        )
        self._programs: dict[tuple[int, int], StepFn] = {}
        self._inline: dict[tuple[int, int], list[StepFn]] = {}  # (start, stop) -> _inline_fns, for _inline_clock
        self._inline_clock: Any = None
        self.lane_runner = LaneRunner(self)
        self._cuts: dict[tuple[int, int], list[tuple[int, int]]] = {}
        self.segments = Segments(self) if compile and self.generate else None
        self.clock: Any = None  # a StepClock (xsched.execute.step_clock) that times the lanes' tasks, when set

    # ---- lanes ----
    def compute_stream(self, device: str) -> Any:
        """The CUDA stream a device's compute lane issues onto: the caller's current stream, so autograd's own
        kernels on that device are ordered with the plan's without extra synchronisation."""
        return torch.cuda.current_stream(self.dev[device])

    def _make_lane(self, key: str) -> Lane:
        kind, where = key.split(":", 1)  # xsched.lanes names: "compute:<d>", "copy:<src>-><dst>", "free:<d>"
        if kind == "free":
            return Lane(key, "free")
        if kind == "compute":
            cuda = self.dev[where].type == "cuda"
            return Lane(key, "cuda" if cuda else "host", self.compute_stream(where) if cuda else None)
        src, dst = (self.dev[d] for d in where.split("->"))
        if src.type == "cuda" or dst.type == "cuda":  # a side stream per direction, on the GPU end
            return Lane(key, "cuda", torch.cuda.Stream(device=src if src.type == "cuda" else dst))
        return Lane(key, "host")

    def close(self) -> None:
        """Stop the lane threads (also done when the executor is garbage-collected)."""
        self._finalizer()

    # ---- running ----
    def start(self, env: Mapping[str, torch.Tensor]) -> RunState:
        """A fresh run with the graph inputs from `env` on their homes; tangents may come later (`bind`)."""
        st = RunState({d: DeviceStore(d, self.dev[d], self.nbytes) for d in self.names})
        for d, ids, tangents in self._homes:
            store, dev = st.stores[d], self.dev[d]
            try:
                tensors = {v: env[v] for v in ids}
            except KeyError as e:
                raise XschedError("no tensor given for graph input", stage="execute", value=e.args[0], device=d) from e
            if dev.type == "cpu":
                moved = [v for v, t in tensors.items() if not t.is_cpu]
            else:
                moved = [v for v, t in tensors.items() if t.device != dev]
            for v in moved:
                tensors[v] = tensors[v].to(dev)
            store.fill(tensors)
            for v in tangents:
                if v in env:
                    store.put(v, env[v].to(dev))
                else:
                    store.reserve(v)
        return st

    def bind(self, st: RunState, env: Mapping[str, torch.Tensor]) -> None:
        """Supply graph inputs reserved at `start` (the tangents, when backward begins)."""
        for v, t in env.items():
            home = self.plan.homes.get(v)
            if home is None or v not in st.stores[home].reserved:
                raise XschedError("bind supplies only graph inputs left out at start", stage="execute", value=v)
            st.stores[home].put(v, t.to(self.dev[home]))

    def run(self, st: RunState, start: int = 0, stop: int | None = None, *, trace: bool = False) -> None:
        """Run steps [start, stop) and wait for them. `trace` runs them one at a time in plan order in the
        calling thread (the reference semantics) and records the bytes resident on each device after each
        step in `st.resident_after`."""
        stop = len(self.plan.steps) if stop is None else stop
        if start != st.next_step or not start <= stop <= len(self.plan.steps):
            raise XschedError(
                f"cannot run steps [{start}, {stop}): the run is at step {st.next_step} of {len(self.plan.steps)}",
                stage="execute",
                step=start,
            )
        t0, kept = time.perf_counter(), len(st.keep)
        with torch.no_grad():
            try:
                if trace or not self.overlap or self._one_device(start, stop):
                    self._run_inline(st, start, stop, trace)
                else:
                    self.lane_runner.run(st, start, stop, one_thread=self.issue == "one")
            except BaseException:
                poison_released(st)
                raise
        st.next_step = stop
        if self.clock is not None:
            forward = self.plan.boundary is None or stop <= self.plan.boundary
            self.clock.run("forward" if forward else "backward", t0, time.perf_counter())
            if len(st.keep) > kept:  # sources staged through pinned memory in this run
                self.clock.staged(len(st.keep) - kept, sum(t.nbytes for t in st.keep[kept:]))

    def _one_device(self, start: int, stop: int) -> bool:
        """True when steps [start, stop) are computes and frees on one device: nothing to overlap."""
        runs = self._runs(start, stop)
        return not runs or (len(runs) == 1 and not isinstance(self.plan.steps[start], Copy))

    def _run_inline(self, st: RunState, start: int, stop: int, trace: bool) -> None:
        if not trace and self.generate:
            for program in self._inline_fns(start, stop):
                program(st)
            return
        self._run_steps(st, start, stop, trace)

    def _inline_fns(self, start: int, stop: int) -> list[StepFn]:
        """Steps [start, stop) as the functions an inline run calls in turn: one-device runs of computes and frees
        as programs, copies between, each timed by the clock when one is set. Built once per slice and clock (the
        plan is fixed; a clock may be set or replaced later), so a run pays no per-step lookups or closures."""
        if self._inline_clock is not self.clock:
            self._inline.clear()
            self._inline_clock = self.clock
        fns = self._inline.get((start, stop))
        if fns is None:
            fns = self._inline[(start, stop)] = [
                self._timed(a, b, self._inline_fn(a, b)) for a, b in self._runs(start, stop)
            ]
        return fns

    def _inline_fn(self, a: int, b: int) -> StepFn:
        """Steps [a, b): a single copy's step function (its errors naming the step), else the run's program."""
        if b - a == 1 and a in self.held:
            return self.fns[a]
        if b - a == 1 and isinstance(self.plan.steps[a], Copy):
            if a in self.d2h:  # the copy must land before host steps read it: _run_steps synchronises
                return lambda st: self._run_steps(st, a, b, trace=False)
            return tagged(self.fns[a], a, self.plan.steps[a])
        program = self._programs.get((a, b))
        if program is None:
            program = self.segments.program(range(a, b)) if self.segments else inline_program(self.prepared, a, b)
            self._programs[(a, b)] = program
        return program

    def _timed(self, a: int, b: int, fn: StepFn) -> StepFn:
        """Steps [a, b) run inline, timed by the clock when one is set."""
        if self.clock is None:
            return fn
        key = self.lane_of[a]
        return self.clock.timed(key, f"steps {a}-{b - 1}", fn, self.lanes[key].stream)

    def _runs(self, start: int, stop: int) -> list[tuple[int, int]]:
        """[start, stop) cut into maximal runs of computes and frees on one device, and single copies."""
        if (start, stop) not in self._cuts:
            steps, cuts, a = self.plan.steps, [], start
            while a < stop:
                b = a + 1
                if not isinstance(steps[a], Copy) and a not in self.held:
                    d = steps[a].device  # type: ignore[union-attr]
                    while b < stop and not isinstance(steps[b], Copy) and b not in self.held and steps[b].device == d:  # type: ignore[union-attr]
                        b += 1
                cuts.append((a, b))
                a = b
            self._cuts[(start, stop)] = cuts
        return self._cuts[(start, stop)]

    def _run_steps(self, st: RunState, start: int, stop: int, trace: bool) -> None:
        for i in range(start, stop):
            try:
                self.fns[i](st)
            except XschedError as e:
                raise at_step(e, i, self.plan.steps[i]) from e
            if i in self.d2h:  # a non-blocking copy to host memory must land before host steps read it
                torch.cuda.current_stream(self.dev[self.plan.steps[i].src]).synchronize()  # type: ignore[union-attr]
            if trace:
                st.resident_after.append(st.resident())

    def outputs(self, st: RunState, values: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
        """The graph outputs (or those of `values`) of a finished run, each from the device where it must end
        (else any holding it)."""
        need = self.must_end_on
        out: dict[str, torch.Tensor] = {}
        for v in self.graph.outputs if values is None else values:
            home = need.get(v)
            t = st.stores[home].tensors.get(v) if home is not None else None
            if t is None:
                where = [d for d, store in st.stores.items() if v in store.tensors]
                if not where:
                    raise PlanError("graph output is not resident anywhere at the end", stage="execute", value=v)
                t = st.stores[where[0]].tensors[v]
            out[v] = t
        return out

    def __call__(self, env: Mapping[str, torch.Tensor], *, trace: bool = False) -> RunTrace:
        """Run the whole plan; the outputs and (with `trace`) the bytes resident after each step."""
        st = self.start(env)
        self.run(st, trace=trace)
        return RunTrace(self.outputs(st), tuple(st.resident_after), self.recomputed)


def _close(lanes: list[Lane]) -> None:
    for lane in lanes:
        lane.close()
