"""Lanes at run time: each lane of the overlapped model (xsched.lanes) is a thread running its steps in plan
order, and steps wait for the steps xsched.lanes.step_waits names through `Done` handles: host events, plus
CUDA events for GPU work.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch

# lane name -> (step index, CUDA event recorded after that step): events on one stream complete in order,
# so the latest per lane stands for all earlier ones
Events = dict[str, tuple[int, Any]]
_NONE: Events = {}


def merge(into: Events, more: Events) -> None:
    for lane, (i, ev) in more.items():
        if lane not in into or into[lane][0] < i:
            into[lane] = (i, ev)


class Flag:
    """A one-shot threading.Event (set once, waited for by any number of threads) on one primitive lock, held from
    its creation to `set`: a lanes run makes one per task, and an Event's Condition costs ten times as much."""

    __slots__ = ("_lock",)

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lock.acquire()

    def set(self) -> None:
        try:
            self._lock.release()  # a primitive lock may be released by another thread than the one that took it
        except RuntimeError:  # set already
            pass

    def is_set(self) -> bool:
        return not self._lock.locked()

    def wait(self) -> None:
        with self._lock:  # each waiter takes the released lock and hands it straight back to the next
            pass


class Done:
    """Completion of one step. `event` is set once the step's host-side work is over (for a CUDA step: once
    it is issued); `cuda` holds the CUDA events after which its device work is over."""

    __slots__ = ("event", "failed", "cuda")

    def __init__(self) -> None:
        self.event = Flag()
        self.failed = False
        self.cuda: Events = _NONE

    def finish(self, failed: bool = False, cuda: Events = _NONE) -> None:
        self.failed = failed
        self.cuda = cuda
        self.event.set()


class Skipped(Exception):
    """A step whose dependency failed: it does not run, and only the first failure is reported."""


@dataclass(slots=True)
class Task:
    index: int
    fn: Callable[[Any], Any]  # returns None, or a CUDA event it recorded on the lane's stream as it ended
    arg: Any
    deps: Sequence[Done]
    done: Done
    errors: list[tuple[int, BaseException]] = field(default_factory=list)


class Lane:
    """One stream. kind "host": CPU work (waits for GPU dependencies by synchronising their events);
    "cuda": issues onto `stream` (waits for GPU dependencies with stream.wait_event, never blocking the host
    on the GPU); "free": releases tensors once their uses are issued, handing the uses' CUDA events on to the
    steps that wait for the free, so on the GPU a later allocation waits for the uses, not the host."""

    def __init__(self, name: str, kind: str, stream: Any = None) -> None:
        self.name = name
        self.kind = kind
        self.stream = stream
        self._q: queue.SimpleQueue[list[Task] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._carry: Events = {}  # free lane: the device work every free so far waited for
        self._waited: dict[str, int] = {}  # lane -> the latest of its steps this lane has waited for in this run

    def submit(self, tasks: list[Task]) -> None:
        """Run `tasks` in order on the lane's thread. A run hands each lane all its tasks at once: one hand-off
        per lane and run, not per task (each still waits for its dependencies)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name=f"xsched-{self.name}", daemon=True)
            self._thread.start()
        self._q.put(tasks)

    def begin(self) -> None:
        """A new run: events of earlier runs are complete on the device (the run ended by waiting for them)."""
        self._carry = {}
        self._waited = {}

    def close(self) -> None:
        if self._thread is not None:
            self._q.put(None)
            self._thread.join()
            self._thread = None

    def _loop(self) -> None:
        torch.set_grad_enabled(False)  # grad mode is per thread; plan steps never build an autograd graph
        with torch.cuda.stream(self.stream) if self.stream is not None else nullcontext():
            while (tasks := self._q.get()) is not None:
                for task in tasks:
                    run_task(self, task)
                # a task holds its run's state, every tensor of it: held while the lane waits for the next run's
                # tasks, it sat in the next run's baseline and was released during it (an H100 store plan
                # measured a peak 31-60% below what it held)
                tasks = task = None

    def wait(self, dep: Done) -> None:
        dep.event.wait()
        if dep.failed:
            raise Skipped
        if self.kind == "free" or not dep.cuda:
            return
        waited = self._waited
        for lane, (i, ev) in dep.cuda.items():
            # a lane's own events are behind it on its stream already, and an event at or before one this lane has
            # waited for is complete by then (a stream completes its events in order): each wait is a CUDA call
            # that hands the GIL over, and a free lane hands on every lane's events to each step waiting for it
            if lane == self.name or waited.get(lane, -1) >= i:
                continue
            waited[lane] = i
            if self.kind == "cuda":
                self.stream.wait_event(ev)
            else:
                ev.synchronize()

    def finished(self, index: int, deps: Sequence[Done], end: Any = None) -> Events:
        """The CUDA events that mark this lane's just-finished step as done on the device. `end`: a CUDA event the
        task recorded on the lane's stream as it ended (a clock's, xsched.execute.step_clock), which marks it done
        as well as a new one would."""
        if self.kind == "cuda":
            if end is None:
                end = torch.cuda.Event()
                end.record(self.stream)
            return {self.name: (index, end)}
        if self.kind == "free":  # frees finish in order, so each stands for every earlier one on the device
            for d in deps:
                merge(self._carry, d.cuda)
            return dict(self._carry) if self._carry else _NONE
        return _NONE


def run_task(lane: Lane, task: Task) -> None:
    """Wait for the task's dependencies, run it, and always mark it done (failed or not) so no lane hangs."""
    try:
        for dep in task.deps:
            lane.wait(dep)
        end = task.fn(task.arg)  # None, or the CUDA event a clock recorded at its end (Task.fn)
        task.done.finish(cuda=lane.finished(task.index, task.deps, end))
    except Skipped:
        task.done.finish(failed=True)
    except BaseException as e:  # reported by the run that submitted the task
        task.errors.append((task.index, e))
        task.done.finish(failed=True)
