"""The one walk over a plan's steps: residency, bytes per device, validity and the step-tagged errors.

In the manner of torch.fx's `Interpreter`: `PlanInterpreter.run` owns the traversal and every rule of the
plan semantics (docs/ARCHITECTURE.md, contract 3), and dispatches each step to a hook for its kind. Passes subclass
it and override only their hooks: the simulator adds times and energy (`xsched.simulate`), the reference
interpreter moves tensors (`xsched.execute.reference`), the executor builds its step functions
(`xsched.execute.executor`). A rule changed here changes all of them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from xsched.contracts.graph import Graph, Op
from xsched.contracts.plan import Compute, Copy, Free, Plan, Step, required_homes, rng_domain
from xsched.contracts.random_ops import random_ops
from xsched.errors import PlanError, XschedError


class PlanInterpreter:
    """Replays `plan` on `graph`, step by step. Hooks (all optional, default no-op):

    - `begin()` before the first step, with graph inputs resident on their homes;
    - `workspace(i, step, op) -> int` the bytes a compute needs beside its outputs (default the op's own);
    - `on_compute(i, step, op)`, `on_copy(i, step)`, `on_free(i, step)` after the step's rules held and before
      residency changes (a compute's outputs, a copy's destination, a free's removal);
    - `after_step(i, step)` once the step's residency and bytes are updated;
    - `end()` after the end-of-plan rules held; `run()` returns its value.

    `stage` names the stage in errors ("plan" for the simulator, "execute" for runs). With `budgets`, memory
    over a device's budget is an error at the step that exceeds it.
    """

    stage = "plan"

    def __init__(self, graph: Graph, plan: Plan, *, check_budgets: bool = False) -> None:
        if plan.graph != graph.fingerprint:
            raise PlanError(f"plan is for graph {plan.graph}, not {graph.fingerprint} ({graph.name})", stage=self.stage)
        self.graph = graph
        self.plan = plan
        self.devices = plan.devices
        self.nbytes = {v.id: v.nbytes for v in graph.values}
        self.budgets: Mapping[str, int] = plan.budgets if check_budgets else {}
        self.randoms = random_ops(graph)
        self.resident: dict[str, set[str]] = {d: set() for d in self.devices}
        self.used = dict.fromkeys(self.devices, 0)
        self.computed: dict[str, int] = {}
        self.drawn_from: dict[str, str] = {}  # random op -> the RNG domain of its first run
        self._check_homes()
        for v, d in plan.homes.items():
            self.resident[d].add(v)
            self.used[d] += self.nbytes[v]
        self.peak = dict(self.used)
        self.peak_step = dict.fromkeys(self.devices, -1)
        for d, budget in self.budgets.items():  # the steps check what they allocate; the homed inputs come first
            if self.used.get(d, 0) > budget:
                raise self.error(
                    f"the inputs homed on {d} take {self.used[d]} B, over its budget of {budget} B before any step",
                    device=d,
                )

    # ---- the walk ----
    def run(self) -> Any:
        self.begin()
        for i, s in enumerate(self.plan.steps):
            if isinstance(s, Compute):
                self._compute(i, s)
            elif isinstance(s, Copy):
                self._copy(i, s)
            elif isinstance(s, Free):
                self._free(i, s)
            else:
                raise PlanError(f"unknown step {s!r}", stage=self.stage, step=i)
            self.after_step(i, s)
        self._check_end()
        return self.end()

    # ---- hooks ----
    def begin(self) -> None:
        pass

    def workspace(self, i: int, s: Compute, op: Op) -> int:
        return op.workspace_bytes

    def on_compute(self, i: int, s: Compute, op: Op) -> None:
        pass

    def on_copy(self, i: int, s: Copy) -> None:
        pass

    def on_free(self, i: int, s: Free) -> None:
        pass

    def after_step(self, i: int, s: Step) -> None:
        pass

    def end(self) -> Any:
        return self

    # ---- the rules ----
    def error(self, message: str, **where: Any) -> PlanError:
        return PlanError(message, stage=self.stage, **where)

    def bump(self, i: int, device: str, during: int, **where: str) -> None:
        """Memory in use on `device` at some point of step `i`: the peak, and the budget when checked."""
        if during > self.peak[device]:
            self.peak[device], self.peak_step[device] = during, i
        budget = self.budgets.get(device)
        if budget is not None and during > budget:
            raise self.error(f"memory {during} B exceeds the budget of {budget} B", step=i, device=device, **where)

    def _compute(self, i: int, s: Compute) -> None:
        op = self.graph.op.get(s.op)
        if op is None:
            raise self.error("compute of an unknown op", step=i, op=s.op, device=s.device)
        here = self.resident[s.device]
        for v in op.inputs:
            if v not in here:
                raise self.error(f"input {v} is not resident on {s.device}", step=i, op=op.id, value=v, device=s.device)
        if op.id in self.randoms:
            first = self.drawn_from.setdefault(op.id, rng_domain(s.device))
            if first != rng_domain(s.device):
                raise self.error(
                    f"random op runs on {s.device} after a first run drawing from the {first} RNG: its draws "
                    "cannot be replayed there",
                    step=i,
                    op=op.id,
                    device=s.device,
                )
        # while a compute runs, its outputs and its workspace count on top of what is resident
        out_bytes = sum(self.nbytes[v] for v in op.outputs)
        self.bump(i, s.device, self.used[s.device] + out_bytes + self.workspace(i, s, op), op=op.id)
        self.on_compute(i, s, op)
        for v in op.outputs:
            if v not in here:
                here.add(v)
                self.used[s.device] += self.nbytes[v]
        self.computed[op.id] = self.computed.get(op.id, 0) + 1

    def _copy(self, i: int, s: Copy) -> None:
        if s.value not in self.nbytes:
            raise self.error("copy of an unknown value", step=i, value=s.value, device=s.src)
        if s.src == s.dst:
            raise self.error("copy to the device it comes from", step=i, value=s.value, device=s.src)
        if s.value not in self.resident[s.src]:
            raise self.error(
                f"value is not resident on {s.src}",
                step=i,
                value=s.value,
                device=s.src,
                op=self.graph.producer.get(s.value),
            )
        if s.value in self.resident[s.dst]:
            raise self.error(f"value is already resident on {s.dst}", step=i, value=s.value, device=s.dst)
        self.on_copy(i, s)
        # a copy counts the value on its destination from its start
        self.resident[s.dst].add(s.value)
        self.used[s.dst] += self.nbytes[s.value]
        self.bump(i, s.dst, self.used[s.dst], value=s.value)

    def _free(self, i: int, s: Free) -> None:
        if s.value not in self.resident[s.device]:
            raise self.error(f"free of a value not resident on {s.device}", step=i, value=s.value, device=s.device)
        if self.plan.homes.get(s.value) == s.device:
            raise self.error("graph input freed on its home device", step=i, value=s.value, device=s.device)
        self.on_free(i, s)
        self.resident[s.device].discard(s.value)
        self.used[s.device] -= self.nbytes[s.value]

    def _check_homes(self) -> None:
        for v in self.graph.inputs:
            if v not in self.plan.homes:
                raise self.error("graph input has no home device", value=v)
        for v in self.plan.homes:
            if v not in self.graph.value or v in self.graph.producer:
                raise self.error("home given for a value that is not a graph input", value=v)

    def _check_end(self) -> None:
        n = len(self.plan.steps)
        for op in self.graph.ops:
            if op.id not in self.computed:
                raise self.error("op is never computed", step=n, op=op.id)
        must_end_on = required_homes(self.graph, self.plan.homes)
        for v in self.graph.outputs:
            where = [d for d, r in self.resident.items() if v in r]
            if not where:
                raise self.error(
                    "graph output is not resident anywhere at the end", step=n, value=v, op=self.graph.producer.get(v)
                )
            need = must_end_on.get(v)
            if need is not None and need not in where:
                raise self.error(
                    f"output must end on {need}, its param's or buffer's home", step=n, value=v, device=need
                )

    def where_output(self, v: str) -> str:
        """The device an output is read from at the end: where it must end, else the first holding it."""
        need = required_homes(self.graph, self.plan.homes).get(v)
        return need if need is not None else next(d for d, r in self.resident.items() if v in r)


def at_step(e: XschedError, i: int, s: Step) -> XschedError:
    """`e` raised while running step `i`, naming the step and, where `e` does not, the step's op, value and device."""
    op = e.op or (s.op if isinstance(s, Compute) else None)
    value = e.value or (s.value if isinstance(s, (Copy, Free)) else None)
    device = e.device or (s.dst if isinstance(s, Copy) else s.device)
    return XschedError(e.detail, stage=e.stage, step=i, op=op, value=value, device=device)


def wrong_size(op: Op, value: str, got: int | str, want: int, device: str | None = None) -> XschedError:
    """A run produced a tensor whose bytes differ from the graph's (the memory model's ground truth)."""
    return XschedError(
        f"{op.target} produced {got} bytes for a value of {want}: the captured shape is wrong",
        stage="execute",
        op=op.id,
        value=value,
        device=device,
    )
