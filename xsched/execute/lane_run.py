"""A slice of the plan run on its lanes: steps grouped into tasks, one thread per stream, waiting as the overlap
model (xsched.lanes) says, and the caller's streams ordered after them. Or, where every lane is a GPU stream (or
frees), issued by the calling thread alone: each task in plan order onto its lane's stream, with the same waits;
the streams overlap on the device as they do from lanes, and no thread hands the GIL to another."""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch

from xsched.errors import XschedError
from xsched.execute.program import step_program
from xsched.execute.steps import RunState, StepFn
from xsched.execute.workers import Done, Lane, Task, run_task
from xsched.interpret import at_step

# a lanes run's lanes and tasks (LaneRunner.lane_tasks): (first step, last step, lane, function, waited-for steps)
LaneTasks = tuple[list[Lane], list[tuple[int, int, Lane, StepFn, tuple[int, ...]]]]


class LaneRunner:
    """Runs steps [start, stop) of an executor's plan on its lanes. Tasks and their functions are built once per
    slice and clock (the plan is fixed), so a run's issuing thread pays no per-task lookups or closures."""

    def __init__(self, ex: Any) -> None:
        self.ex = ex
        self._plans: dict[tuple[int, int], LaneTasks] = {}
        self._clock: Any = None  # the clock _plans' functions are timed by
        self._groups: dict[tuple[int, int], list[tuple[int, ...]]] = {}

    def run(self, st: RunState, start: int, stop: int, one_thread: bool = False) -> None:
        """Submit every task to its lane, wait for the last of each lane, and order later work on each GPU's
        compute stream after them; the first error (in plan order) is raised, naming its step. `one_thread`: issue
        the tasks from this thread, in plan order, where no lane runs host work (which would block the others)."""
        ex = self.ex
        used, tasks = self.lane_tasks(start, stop)
        one_thread = one_thread and all(lane.kind != "host" for lane in used)
        for lane in used:
            lane.begin()
            if lane.kind == "cuda":  # work of earlier slices and of the caller, on the compute streams, comes first
                for d in ex.names:
                    if ex.dev[d].type == "cuda" and ex.dev[d] == lane.stream.device:
                        lane.stream.wait_stream(ex.compute_stream(d))
        dones: dict[int, Done] = {}  # the last step of each task -> its Done: nothing waits for the others
        last: dict[str, Done] = {}
        errors: list[tuple[int, BaseException]] = []
        batches: dict[Lane, list[Task]] = {lane: [] for lane in used}
        for i, end, lane, fn, waits in tasks:
            done = dones[end] = Done()
            task = Task(i, fn, st, [dones[j] for j in waits], done, errors)
            if one_thread:  # every task it waits for is issued already: it comes earlier in plan order
                with torch.cuda.stream(lane.stream) if lane.stream is not None else nullcontext():
                    run_task(lane, task)
            else:
                batches[lane].append(task)
            last[lane.name] = done
        for lane, batch in batches.items():
            if batch:
                lane.submit(batch)
        for done in last.values():
            done.event.wait()
        for d in ex.names:  # later work on each GPU's compute stream waits for every lane's last step
            if ex.dev[d].type == "cuda":
                cur = ex.compute_stream(d)
                for done in last.values():
                    for _, ev in done.cuda.values():
                        cur.wait_event(ev)
        if errors:
            i, e = min(errors, key=lambda x: x[0])
            i = e.step if isinstance(e, XschedError) and e.step is not None else i
            if isinstance(e, XschedError):
                raise at_step(e, i, ex.plan.steps[i]) from e
            raise XschedError(f"{type(e).__name__}: {e}", stage="execute", step=i) from e

    def lane_tasks(self, start: int, stop: int) -> LaneTasks:
        """The lanes steps [start, stop) use, in the order of their first step, and the tasks a lanes run submits:
        (first step, last step, lane, function, the last steps of the earlier tasks it waits for), each function
        timed by the clock when one is set."""
        ex = self.ex
        if self._clock is not ex.clock:
            self._plans.clear()
            self._clock = ex.clock
        out = self._plans.get((start, stop))
        if out is not None:
            return out
        tasks = []
        for group in self.tasks(start, stop):
            i, key = group[0], ex.lane_of[group[0]]
            lane = ex.lanes[key]
            fn = ex.fns[i] if len(group) == 1 else self._run_group(group)
            if ex.segments and key.startswith("compute:") and len(group) > 1:
                fn = ex.segments.program(group)
            elif ex.generate and key.startswith("compute:") and i not in ex.held:
                fn = step_program(ex.prepared, group, shared=True)  # a call per op, not closures per argument
            if ex.clock is not None:
                fn = ex.clock.timed(key, f"steps {i}-{group[-1]}", fn, lane.stream)
            tasks.append((i, group[-1], lane, fn, tuple(j for j in ex.deps[i] if j >= start)))
        used = list(dict.fromkeys(ex.lanes[ex.lane_of[i]] for i in range(start, stop)))
        out = self._plans[(start, stop)] = (used, tasks)
        return out

    def tasks(self, start: int, stop: int) -> list[tuple[int, ...]]:
        """Steps [start, stop) cut into tasks: runs of one lane's steps, in plan order, where only the first waits
        for another lane and only the last is waited for by another lane. One hand-off per task, not per step."""
        if (start, stop) not in self._groups:
            deps, lane_of, held = self.ex.deps, self.ex.lane_of, self.ex.held
            waited = {j for i in range(start, stop) for j in deps[i] if j >= start}
            groups: list[list[int]] = []
            open_: dict[str, list[int]] = {}  # lane -> its group still taking steps
            for i in range(start, stop):
                key = lane_of[i]
                if key not in open_ or any(j >= start for j in deps[i]) or i in held:  # a held step runs alone
                    open_[key] = []
                    groups.append(open_[key])
                open_[key].append(i)
                if i in waited or i in held:
                    del open_[key]
            self._groups[(start, stop)] = [tuple(g) for g in groups]
        return self._groups[(start, stop)]

    def _run_group(self, group: tuple[int, ...]) -> StepFn:
        fns, steps = self.ex.fns, self.ex.plan.steps

        def run(st: RunState) -> None:
            for i in group:
                try:
                    fns[i](st)
                except XschedError as e:
                    raise at_step(e, i, steps[i]) from e
                except Exception as e:
                    raise XschedError(f"{type(e).__name__}: {e}", stage="execute", step=i) from e

        return run
