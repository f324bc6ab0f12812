"""Parameters on a home of their own (`wrap(..., param_home=)`): the homes that put them there, and telling an
optimizer beside the run when each parameter is free to update: the steps that read a parameter on its home or make
its gradient final there, counted down per run, and the copy step kind that makes a copy out of a home wait for the
parameter's update and reports each parameter released once the run is done with it there."""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from xsched.contracts.graph import Graph
from xsched.contracts.plan import Compute, Copy, Plan
from xsched.errors import XschedError
from xsched.execute.arena import prepare_arena_copy
from xsched.execute.compiled import getter
from xsched.execute.executor import Executor
from xsched.execute.steps import RunState, StepFn, prepare_copy
from xsched.lanes import lane_of


def param_homes(graph: Graph, device: str) -> dict[str, str]:
    """The homes that put every param and buffer input of `graph` on `device` (the rest stay on the first device)."""
    return {v: device for v in graph.inputs if graph.value[v].kind in ("param", "buffer")}


def check_homes(graph: Graph, plan: Plan, device: str) -> None:
    """A given plan must home every param and buffer on `device`, except, in a plan that homes some params there,
    params homed on a device that computes (their optimizer runs there: train.placement's split)."""
    computes = {s.device for s in plan.steps if isinstance(s, Compute)}
    wanted = param_homes(graph, device)
    split = any(plan.homes.get(v) == device for v in wanted if graph.value[v].kind == "param")

    def fits(v: str, d: str) -> bool:
        home = plan.homes.get(v)
        return home == d or (split and graph.value[v].kind == "param" and home in computes)

    wrong = next((v for v, d in wanted.items() if not fits(v, d)), None)
    if wrong is not None:
        raise XschedError(
            f"the given plan homes {graph.value[wrong].name} on {plan.homes.get(wrong)}, not on param_home {device}",
            stage="execute",
            value=wrong,
        )


class ParamListener(Protocol):
    """What a run calls, from any of its lanes' threads. `takes_grads`: the listener keeps the gradients it is
    handed, and autograd gets None for those parameters (their `.grad` is left as it is)."""

    takes_grads: bool

    def wait(self, name: str) -> None:
        """Return once parameter `name` may be read: no update of it is under way."""

    def released(self, name: str, grad: torch.Tensor | None, events: Sequence[Any]) -> None:
        """The run reads `name` on its home no more and its gradient there is final: `grad` (None when the plan
        makes none), whose contents are complete once every CUDA event in `events` is."""


@dataclass
class ListenerSlot:
    """The listener of one wrapped module, shared by every plan it compiles (None: the runs report nothing)."""

    listener: ParamListener | None = None


@dataclass
class _Marks:
    left: dict[str, int]
    events: dict[str, list[Any]] = field(default_factory=dict)


class ParamPoints:
    """For one plan: each parameter's marks (the copies that read it out of its home, and the step that makes its
    gradient final there, when that is a copy) counted down per run, then released. A parameter read on its home by
    a compute, or whose gradient a compute makes there, is waited for when the run starts and released at its end:
    correct, without overlap (a home that computes is not what the hooks are for)."""

    def __init__(self, graph: Graph, plan: Plan, slot: ListenerSlot) -> None:
        self.slot = slot
        vid = {graph.value[v].name: v for v in graph.inputs if graph.value[v].kind == "param"}
        home = {n: plan.homes[v] for n, v in vid.items()}
        name_of = {v: n for n, v in vid.items()}
        grads = {n: r for n, r in (graph.grads or {}).items() if n in home and r is not None}
        grad_name = {r["ref"]: n for n, r in grads.items()}
        marks: dict[str, set[int]] = {n: set() for n in home}
        final: dict[str, int] = {}  # the last step that makes each gradient resident on its param's home
        at_end: set[str] = set()
        for i, s in enumerate(plan.steps):
            if isinstance(s, Copy):
                n = name_of.get(s.value)
                if n is not None and s.src == home[n]:
                    marks[n].add(i)
                g = grad_name.get(s.value)
                if g is not None and s.dst == home[g]:
                    final[g] = i
            elif isinstance(s, Compute):
                op = graph.op[s.op]
                at_end.update(n for v in op.inputs if (n := name_of.get(v)) is not None and home[n] == s.device)
                for v in op.outputs:
                    g = grad_name.get(v)
                    if g is not None and home[g] == s.device:
                        final[g] = i
        for n, i in final.items():
            if isinstance(plan.steps[i], Copy):
                marks[n].add(i)
            else:
                at_end.add(n)
        self.count = {n: len(m) for n, m in marks.items() if m and n not in at_end}
        self.at_end = tuple(n for n in home if n not in self.count)
        self.marks: dict[int, list[str]] = {}
        for n in self.count:
            for i in marks[n]:
                self.marks.setdefault(i, []).append(n)
        # the copies that bring a gradient home as the very value the listener is handed: they may land in it
        self.grad_into = {
            i: n
            for n, i in final.items()
            if n in self.count and isinstance(plan.steps[i], Copy) and plan.steps[i].value == grads[n]["ref"]
        }
        self.reads = {
            i: n
            for n in self.count
            for i in marks[n]
            if isinstance(plan.steps[i], Copy) and plan.steps[i].value == vid[n]
        }  # type: ignore[union-attr]
        released = [*sorted(self.count, key=lambda n: max(marks[n])), *self.at_end]
        self.order = tuple(n for n in released if n in grads)  # params with gradients, in the order they are released
        first_read = {n: i for i, n in sorted(self.reads.items(), reverse=True)}  # read at run start: at_end
        self.read_order = tuple(sorted(self.order, key=lambda n: first_read.get(n, -1)))  # the order a run reads them
        self._grad = {n: (home[n], grads[n]) for n in grads}
        self._getters: dict[str, Callable[[Mapping[str, torch.Tensor]], torch.Tensor]] = {}
        self._homes: dict[str, str] = {}
        self._cuda: list[torch.device] = []
        self._runs: dict[int, _Marks] = {}
        self._lock = threading.Lock()

    def bind(self, ex: Executor) -> None:
        """Resolve the gradient getters on the executor's devices."""
        self._getters = {n: getter(r, ex.dev[h]) for n, (h, r) in self._grad.items()}
        self._homes = {n: h for n, (h, _) in self._grad.items()}
        self._cuda = [d for d in ex.dev.values() if d.type == "cuda"]

    def begin(self, st: RunState) -> None:
        """A run starts: the parameters read by computes on their home wait for their updates now."""
        listener = self.slot.listener
        if listener is None:
            return
        for n in self.at_end:
            listener.wait(n)
        with self._lock:
            self._runs[id(st)] = _Marks(dict(self.count))

    def end(self, st: RunState) -> None:
        """The run is over: release the parameters kept to the end (after the device work issued so far)."""
        with self._lock:
            run = self._runs.pop(id(st), None)
        listener = self.slot.listener
        if run is None or listener is None or not self.at_end:
            return
        events = [_event(d) for d in self._cuda]
        for n in self.at_end:
            listener.released(n, self._grad_of(st, n), events)

    def mark(self, st: RunState, names: Sequence[str], event: Any) -> None:
        with self._lock:
            run = self._runs.get(id(st))
            if run is None:
                return
            done = []
            for n in names:
                if event is not None:
                    run.events.setdefault(n, []).append(event)
                run.left[n] -= 1
                if run.left[n] == 0:
                    done.append((n, run.events.pop(n, [])))
        listener = self.slot.listener
        for n, events in done:
            if listener is not None:
                listener.released(n, self._grad_of(st, n), events)

    def _grad_of(self, st: RunState, name: str) -> torch.Tensor | None:
        get = self._getters.get(name)
        return get(st.stores[self._homes[name]].tensors) if get is not None else None

    def copy_kind(self, ex: Executor, i: int, s: Copy) -> StepFn:
        """The executor's step kind for copies: a read out of a home waits for the parameter's update; a marked
        copy counts down the parameters it marks, with a CUDA event after it where it runs on a GPU."""
        fn = (prepare_arena_copy if ex.arena is not None else prepare_copy)(ex, i, s)  # into its slot, if planned
        read, names = self.reads.get(i), self.marks.get(i)
        if read is None and names is None:
            return fn
        gpu = next((ex.dev[d] for d in (s.src, s.dst) if ex.dev[d].type == "cuda"), None)
        slot = self.slot
        into = self.grad_into.get(i)
        if into is not None and ex.dev[s.dst].type == "cpu":
            fn = _into_buffer(ex, s, into, slot, fn)

        def copy(st: RunState) -> None:
            listener = slot.listener
            if listener is None:
                fn(st)
                return
            if read is not None:
                listener.wait(read)
            fn(st)
            if names is not None:
                self.mark(st, names, _event(gpu) if gpu is not None else None)

        return copy


def _into_buffer(ex: Executor, s: Copy, name: str, slot: ListenerSlot, fn: StepFn) -> StepFn:
    """A gradient's copy home straight into the buffer the listener offers for it (`grad_buffer(name)`: its
    optimizer's own, pinned beside a GPU), sparing the optimizer a host copy; the plain copy when it offers none.
    A listener with `copying(name, grad)` sees the gradient first, on its device and the copy's stream (it may take
    the gradient's norm there)."""
    cuda = ex.dev[s.src].type == "cuda"
    side = ex.lanes[lane_of(s)].stream if cuda else None
    v, src, dst = s.value, s.src, s.dst

    def copy(st: RunState) -> None:
        offer = getattr(slot.listener, "grad_buffer", None)
        buf = offer(name) if offer is not None else None
        t = st.stores[src].tensors[v]
        seen = getattr(slot.listener, "copying", None)
        if seen is not None:
            seen(name, t)
        if buf is None or buf.dtype != t.dtype or buf.numel() != t.numel() or (cuda and not buf.is_pinned()):
            fn(st)
            return
        out = buf.view(t.shape)
        if cuda:
            t.record_stream(side)  # the caching allocator keeps t until this stream's copy is done
            out.copy_(t, non_blocking=True)
        else:
            out.copy_(t)
        st.stores[dst].put(v, out)

    return copy


def _makes(graph: Graph, s: Any, value: str, device: str) -> bool:
    if isinstance(s, Copy):
        return s.value == value and s.dst == device
    return isinstance(s, Compute) and s.device == device and value in graph.op[s.op].outputs


def _event(device: torch.device) -> Any:
    ev = torch.cuda.Event()
    ev.record(torch.cuda.current_stream(device))
    return ev
