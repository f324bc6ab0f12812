"""The plan semantics: validity, per-device memory timeline and peak, sequential time, makespan, energy.

This is the one place that implements ARCHITECTURE.md's semantics; solvers, the executor and
tests all check plans through `simulate`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from xsched.errors import PlanError
from xsched.graph import Graph
from xsched.lanes import overlapped_spans, step_waits
from xsched.ops import random_ops
from xsched.plan import Compute, Copy, Free, Plan, Prediction, required_homes, rng_domain
from xsched.profile import Profile


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


def simulate(
    graph: Graph,
    plan: Plan,
    profile: Profile | None = None,
    *,
    check_budgets: bool = True,
) -> SimResult:
    """Replay `plan` on `graph`; raise PlanError naming the step, op, value and device at fault."""
    if plan.graph != graph.fingerprint:
        raise PlanError(f"plan is for graph {plan.graph}, not {graph.fingerprint} ({graph.name})", stage="plan")
    if profile is not None:
        profile.check_graph(graph.fingerprint)
    _check_homes(graph, plan)
    nbytes = {v.id: v.nbytes for v in graph.values}
    devices = plan.devices
    resident: dict[str, set[str]] = {d: set() for d in devices}
    used = dict.fromkeys(devices, 0)
    for v, d in plan.homes.items():
        resident[d].add(v)
        used[d] += nbytes[v]
    peak = dict(used)
    peak_step = dict.fromkeys(devices, -1)
    budgets = plan.budgets if check_budgets else {}
    timed = profile is not None
    seq_time = 0.0
    energy = 0.0
    durations: list[float] = []
    randoms = random_ops(graph)
    drawn_from: dict[str, str] = {}  # random op -> the RNG of its first run
    after: list[dict[str, int]] = []
    computed: set[str] = set()
    copy_bytes = n_copies = n_computes = 0

    def bump(i: int, d: str, during: int, **where: str) -> None:
        if during > peak[d]:
            peak[d], peak_step[d] = during, i
        if d in budgets and during > budgets[d]:
            raise PlanError(f"memory {during} B exceeds the budget of {budgets[d]} B", step=i, device=d, **where)

    for i, s in enumerate(plan.steps):
        if isinstance(s, Compute):
            if s.op not in graph.op:
                raise PlanError("compute of an unknown op", step=i, op=s.op, device=s.device)
            op = graph.op[s.op]
            for v in op.inputs:
                if v not in resident[s.device]:
                    raise PlanError(
                        f"input {v} is not resident on {s.device}", step=i, op=op.id, value=v, device=s.device
                    )
            cost = profile.op_cost(op.id, s.device) if profile is not None else None
            if profile is not None and cost is None:
                raise PlanError(
                    f"op cannot run on {s.device} (no cost in the profile)", step=i, op=op.id, device=s.device
                )
            workspace = max(op.workspace_bytes, cost.workspace_bytes if cost else 0)
            bump(i, s.device, used[s.device] + sum(nbytes[v] for v in op.outputs) + workspace, op=op.id)
            for v in op.outputs:
                if v not in resident[s.device]:
                    resident[s.device].add(v)
                    used[s.device] += nbytes[v]
            if op.id in randoms and drawn_from.setdefault(op.id, rng_domain(s.device)) != rng_domain(s.device):
                raise PlanError(
                    f"random op runs on {s.device} after a first run drawing from the {drawn_from[op.id]} RNG: "
                    "its draws cannot be replayed there",
                    step=i, op=op.id, device=s.device,
                )  # fmt: skip
            t = cost.time_s if cost else 0.0
            seq_time += t
            energy += cost.energy_j if cost else 0.0
            durations.append(t)
            computed.add(op.id)
            n_computes += 1
        elif isinstance(s, Copy):
            if s.value not in nbytes:
                raise PlanError("copy of an unknown value", step=i, value=s.value, device=s.src)
            if s.src == s.dst:
                raise PlanError("copy to the device it comes from", step=i, value=s.value, device=s.src)
            if s.value not in resident[s.src]:
                raise PlanError(
                    f"value is not resident on {s.src}",
                    step=i,
                    value=s.value,
                    device=s.src,
                    op=graph.producer.get(s.value),
                )
            if s.value in resident[s.dst]:
                raise PlanError(f"value is already resident on {s.dst}", step=i, value=s.value, device=s.dst)
            t = 0.0
            if profile is not None:
                ct = profile.copy_time(s.value, nbytes[s.value], s.src, s.dst)
                if ct is None:
                    raise PlanError(
                        f"no copy link {s.src}->{s.dst} in the profile", step=i, value=s.value, device=s.dst
                    )
                t = ct
                energy += profile.copy_energy(nbytes[s.value], s.src, s.dst)
            resident[s.dst].add(s.value)
            used[s.dst] += nbytes[s.value]
            bump(i, s.dst, used[s.dst], value=s.value)
            seq_time += t
            durations.append(t)
            copy_bytes += nbytes[s.value]
            n_copies += 1
        elif isinstance(s, Free):
            if s.value not in resident.get(s.device, ()):
                raise PlanError(f"free of a value not resident on {s.device}", step=i, value=s.value, device=s.device)
            if plan.homes.get(s.value) == s.device:
                raise PlanError("graph input freed on its home device", step=i, value=s.value, device=s.device)
            resident[s.device].discard(s.value)
            used[s.device] -= nbytes[s.value]
            durations.append(0.0)
        else:
            raise PlanError(f"unknown step {s!r}", step=i)
        after.append(dict(used))

    _check_end(graph, plan, resident, computed)
    spans = overlapped_spans(plan.steps, durations, step_waits(graph, plan.steps, randoms)) if timed else []
    return SimResult(
        peak_bytes=peak,
        peak_step=peak_step,
        resident_after=tuple(after),
        time_s=seq_time if timed else None,
        makespan_s=max((e for _, e in spans), default=0.0) if timed else None,
        energy_j=energy if timed else None,
        step_span=tuple(spans),
        computes=n_computes,
        copies=n_copies,
        copy_bytes=copy_bytes,
    )


def _check_homes(graph: Graph, plan: Plan) -> None:
    for v in graph.inputs:
        if v not in plan.homes:
            raise PlanError("graph input has no home device", stage="plan", value=v)
    for v in plan.homes:
        if v not in graph.value or v in graph.producer:
            raise PlanError("home given for a value that is not a graph input", stage="plan", value=v)


def _check_end(graph: Graph, plan: Plan, resident: Mapping[str, set[str]], computed: set[str]) -> None:
    n = len(plan.steps)
    for op in graph.ops:
        if op.id not in computed:
            raise PlanError("op is never computed", step=n, op=op.id)
    must_end_on = required_homes(graph, plan.homes)
    for v in graph.outputs:
        where = [d for d, r in resident.items() if v in r]
        if not where:
            raise PlanError(
                "graph output is not resident anywhere at the end", step=n, value=v, op=graph.producer.get(v)
            )
        need = must_end_on.get(v)
        if need is not None and need not in where:
            raise PlanError(f"output must end on {need}, its param's or buffer's home", step=n, value=v, device=need)
