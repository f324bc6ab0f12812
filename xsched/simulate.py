"""The plan semantics as numbers: per-device memory timeline and peak, sequential time, makespan, energy.

The rules themselves (validity, residency, bytes) are walked once, in `xsched.interpret`; the simulator adds
what each step costs from the profile. Solvers, the executor and tests all check plans through `simulate`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from xsched.contracts.graph import Graph, Op
from xsched.contracts.plan import Compute, Copy, Free, Plan, Prediction, Step
from xsched.contracts.profile import Profile
from xsched.errors import XschedError
from xsched.interpret import PlanInterpreter
from xsched.lanes import timed_spans


@dataclass(frozen=True)
class SimResult:
    """What a valid plan does: memory per device after each step, its peaks, its times and energy."""

    peak_bytes: Mapping[str, int]
    peak_step: Mapping[str, int]  # step index at which each device peaks (-1: before any step)
    resident_after: tuple[Mapping[str, int], ...]  # bytes resident per device after each step
    time_s: float | None  # sequential: sum of compute and copy times
    makespan_s: float | None  # overlapped: one compute stream per device, one copy stream per pair
    energy_j: float | None
    step_span: tuple[tuple[float, float], ...]  # overlapped (start, end) of each step (xsched.lanes); none untimed
    computes: int
    copies: int
    copy_bytes: int

    def prediction(self) -> Prediction:
        return Prediction(self.time_s, dict(self.peak_bytes), self.energy_j, self.makespan_s)


class Simulator(PlanInterpreter):
    """The interpreter's walk with each step's profiled time and energy (untimed without a profile)."""

    def __init__(
        self, graph: Graph, plan: Plan, profile: Profile | None, *, check_budgets: bool, lanes: bool = True
    ) -> None:
        super().__init__(graph, plan, check_budgets=check_budgets)
        if profile is not None:
            profile.check_graph(graph.fingerprint)
        self.profile = profile
        self.lanes = lanes
        self.time = self.energy = 0.0
        self.durations: list[float] = []
        self.after: list[dict[str, int]] = []
        self.copy_bytes = self.copies = 0

    def workspace(self, i: int, s: Compute, op: Op) -> int:
        cost = self.profile.op_cost(op.id, s.device) if self.profile is not None else None
        if self.profile is not None and cost is None:
            raise self.error(f"op cannot run on {s.device} (no cost in the profile)", step=i, op=op.id, device=s.device)
        self._cost = cost
        return max(op.workspace_bytes, cost.workspace_bytes if cost else 0)

    def on_compute(self, i: int, s: Compute, op: Op) -> None:
        cost = self._cost
        self.time += cost.time_s if cost else 0.0
        self.energy += cost.energy_j if cost else 0.0
        self.durations.append(cost.time_s if cost else 0.0)

    def on_copy(self, i: int, s: Copy) -> None:
        t, n = 0.0, self.nbytes[s.value]
        if self.profile is not None:
            ct = self.profile.copy_time(s.value, n, s.src, s.dst)
            if ct is None:
                raise self.error(f"no copy link {s.src}->{s.dst} in the profile", step=i, value=s.value, device=s.dst)
            t = ct
            self.energy += self.profile.copy_energy(n, s.src, s.dst)
        self.time += t
        self.durations.append(t)
        self.copy_bytes += n
        self.copies += 1

    def on_free(self, i: int, s: Free) -> None:
        self.durations.append(0.0)

    def after_step(self, i: int, s: Step) -> None:
        self.after.append(dict(self.used))

    def end(self) -> SimResult:
        timed = self.profile is not None
        steps = self.plan.steps
        overlap = timed and self.lanes
        spans = timed_spans(self.graph, steps, self.durations, self.randoms) if overlap else []
        return SimResult(
            peak_bytes=self.peak,
            peak_step=self.peak_step,
            resident_after=tuple(self.after),
            time_s=self.time if timed else None,
            makespan_s=max((e for _, e in spans), default=0.0) if overlap else None,
            energy_j=self.energy if timed else None,
            step_span=tuple(spans),
            computes=sum(self.computed.values()),
            copies=self.copies,
            copy_bytes=self.copy_bytes,
        )


def simulate(
    graph: Graph,
    plan: Plan,
    profile: Profile | None = None,
    *,
    check_budgets: bool = True,
    lanes: bool = True,
) -> SimResult:
    """Replay `plan` on `graph`; raise PlanError naming the step, op, value and device at fault. Without `lanes`,
    no makespan (the overlap of the devices' lanes, most of the cost on large plans): peaks and serial time only."""
    return Simulator(graph, plan, profile, check_budgets=check_budgets, lanes=lanes).run()


def predicted_plan(graph: Graph, plan: Plan, profile: Profile, source: str) -> Plan:
    """`plan` with its prediction, replayed within its budgets. A solver's model is meant to be conservative, so a
    plan it extracted that fails here is a bug of `source` (named in the error), never a plan to return."""
    try:
        result = simulate(graph, plan, profile, check_budgets=True)
    except XschedError as e:
        raise XschedError(
            f"internal error: {source} fails the simulator: {e.detail}",
            stage="solve",
            op=e.op,
            value=e.value,
            device=e.device,
            step=e.step,
        ) from e
    return Plan(**{**plan.__dict__, "predicted": result.prediction()})
