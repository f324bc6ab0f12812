"""The ONNX Runtime executor's preparation: a plan cut into segments (a run of computes on one provider, one
session), copies and frees, as hooks on the plan interpreter (so its rules, budgets and step-tagged errors are the
simulator's). The rules where a segment ends and when frees happen are in `xsched.execute.ort_executor`'s docstring."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from xsched.contracts.graph import Graph, Op
from xsched.contracts.onnx_ops import RANDOM_OPS, op_type, static_array
from xsched.contracts.plan import Compute, Copy, Free, Plan
from xsched.devices.ort import OrtDevice
from xsched.interpret import PlanInterpreter


@dataclass(frozen=True)
class Segment:
    """Consecutive computes of one device run as one session."""

    device: str
    steps: tuple[int, ...]  # plan steps of its computes
    ops: tuple[str, ...]
    renames: tuple[Mapping[str, str], ...]  # per op: values named otherwise in the session (ops computed again)
    feeds: tuple[str, ...]  # bound from the device's store
    params: tuple[str, ...]  # params homed on the device, given to the session as initializers
    outputs: tuple[str, ...]  # put in the device's store...
    output_names: tuple[str, ...]  # ...from these session outputs


@dataclass(frozen=True)
class Action:
    """What the executor does, in order: a segment's session, a copy or a free. `at`: the plan step after which
    the stores of `exact` devices hold exactly what the plan says is resident (the byte check of a traced run)."""

    do: Segment | Copy | Free
    step: int
    at: int
    exact: frozenset[str]


@dataclass
class _Open:
    device: str
    steps: list[int] = field(default_factory=list)
    ops: list[str] = field(default_factory=list)
    renames: list[dict[str, str]] = field(default_factory=list)
    reads: dict[str, None] = field(default_factory=dict)  # values fed from the store, in first-use order
    name: dict[str, str] = field(default_factory=dict)  # value computed here -> its name in the session
    deferred: dict[str, int] = field(default_factory=dict)  # fed values the plan frees before it ends -> step


class OverBudget(Exception):
    """Deferred frees would exceed a budget at the compute of `step`: its device's segment must end before it."""

    def __init__(self, step: int) -> None:
        self.step = step


class Segmenter(PlanInterpreter):
    """The executor's preparation as hooks on the plan interpreter: segments, copies and frees, in order.

    A session holds its feeds until it ends, so a free of a value the open segment reads is deferred to the
    segment's end, and its bytes counted until then (the interpreter's peak becomes the executor's). Where that
    would exceed a budget, at a compute in `cuts`, the segment ends before that compute and its deferred frees
    happen there."""

    stage = "execute"

    def __init__(
        self,
        graph: Graph,
        plan: Plan,
        devices: Mapping[str, OrtDevice],
        *,
        check_budgets: bool,
        cuts: frozenset[int] = frozenset(),
    ) -> None:
        super().__init__(graph, plan, check_budgets=check_budgets)
        self.dev, self.cuts = devices, cuts
        self.open: dict[str, _Open] = {}
        self.actions: list[Action] = []
        self.deferred = dict.fromkeys(self.devices, 0)  # bytes whose free waits for the device's segment to end

    def bump(self, i: int, device: str, during: int, **where: str) -> None:
        budget, extra = self.budgets.get(device), self.deferred[device]
        if extra and budget is not None and during <= budget < during + extra:
            raise OverBudget(i)
        super().bump(i, device, during + extra, **where)

    def workspace(self, i: int, s: Compute, op: Op) -> int:
        # the last hook before this compute's bytes are counted: a cut here frees the deferred values first
        if i in self.cuts and s.device in self.open:
            self._close(s.device, i)
        return super().workspace(i, s, op)

    def on_compute(self, i: int, s: Compute, op: Op) -> None:
        if op_type(op) in RANDOM_OPS and op.id in self.computed:
            raise self.error(
                f"{op_type(op)} recomputed: ONNX Runtime cannot draw its numbers again",
                step=i,
                op=op.id,
                device=s.device,
            )
        seg = self.open.get(s.device)
        if seg is not None and any(v in seg.deferred for v in op.outputs):  # its deferred free must come first
            self._close(s.device, i)
            seg = None
        if seg is None:
            seg = self.open[s.device] = _Open(s.device)
        rename = {v: seg.name[v] for v in op.inputs if seg.name.get(v, v) != v}
        seg.reads.update((v, None) for v in op.inputs if v not in seg.name)
        again = any(v in seg.name or v in seg.reads for v in op.outputs)  # computed again in this session
        for v in op.outputs:
            seg.name[v] = f"{v}@{len(seg.ops)}" if again else v
            if again:
                rename[v] = seg.name[v]
        seg.steps.append(i)
        seg.ops.append(op.id)
        seg.renames.append(rename)

    def on_copy(self, i: int, s: Copy) -> None:
        if s.dst in self.open:  # the segment's later computes may read the copy: it must not run before it
            self._close(s.dst, i)
        seg = self.open.get(s.src)
        if seg is not None and s.value in seg.name:  # the copy reads the session's output
            self._close(s.src, i)
        self._emit(s, i, i)

    def on_free(self, i: int, s: Free) -> None:
        seg = self.open.get(s.device)
        if seg is not None:
            if s.value in seg.reads:  # the session holds its feeds while it runs
                seg.deferred[s.value] = i
                self.deferred[s.device] += self.nbytes[s.value]
                return
            elif s.value in seg.name:  # computed and dead inside the session: ONNX Runtime frees it
                return
        self._emit(s, i, i)

    def end(self) -> list[Action]:
        for d in list(self.open):
            self._close(d, len(self.plan.steps))
        return self.actions

    def _emit(self, do: Segment | Copy | Free, step: int, at: int, inexact: str | None = None) -> None:
        exact = frozenset(d for d in self.devices if d not in self.open and d != inexact)
        self.actions.append(Action(do, step, at, exact))

    def _close(self, device: str, i: int) -> None:
        """End the device's segment at step i (before i's own effect): its outputs are what it computed and is
        still resident; then its deferred frees."""
        seg = self.open.pop(device)
        here = self.resident[device]
        inline_ok = self.dev[device].params_as_initializers
        params = tuple(
            v
            for v in seg.reads
            if self._param_here(v, device) and (inline_ok or static_array(self.graph.value[v]) is not None)
        )
        outputs = tuple(v for v in seg.name if v in here)
        feeds = tuple(v for v in seg.reads if v not in params)
        if outputs:  # a segment whose values all die inside it has nothing to run for
            segment = Segment(
                device,
                tuple(seg.steps),
                tuple(seg.ops),
                tuple(seg.renames),
                feeds,
                params,
                outputs,
                tuple(seg.name[v] for v in outputs),
            )
            self._emit(segment, seg.steps[0], i - 1, inexact=device if seg.deferred else None)
        last = len(seg.deferred) - 1
        for k, v in enumerate(seg.deferred):
            self._emit(Free(v, device), seg.deferred[v], i - 1, inexact=device if k < last else None)
            self.deferred[device] -= self.nbytes[v]

    def _param_here(self, v: str, device: str) -> bool:
        return self.graph.value[v].kind == "param" and self.plan.homes.get(v) == device
