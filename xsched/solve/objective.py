"""The one objective every solver ranks plans by (`objective`, `better`, `best_of`: no solver compares plans
otherwise): the predicted makespan (the lanes model's overlapped time, what the executor's streams achieve) plus
alpha x energy; equal objectives go to the plan with the least sequential time (fewer or smaller copies and reruns:
the same predicted step with less work for the model to be wrong about). Changing what "better" means is a change
here and nowhere else. `objective_floor` is the bound no plan goes under; the runner measures gaps against it, or
against the stage MILP's bound where that is higher (solve/runner.py, `_labelled`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from xsched.contracts.graph import Graph
from xsched.contracts.plan import Plan
from xsched.contracts.profile import Profile
from xsched.solve.bounds.time import time_bound


def objective(plan: Plan, alpha_energy: float = 0.0) -> float:
    """The plan's predicted makespan + alpha x its predicted energy (seconds)."""
    p = plan.predicted
    assert p is not None and p.makespan_s is not None, "objective of a plan not simulated with its lanes"
    return p.makespan_s + alpha_energy * (p.energy_j or 0.0)


def better(
    plan: Plan | None,
    than: Plan | None,
    alpha_energy: float = 0.0,
    *,
    tolerance: float = 1e-12,
    tie_break: bool = True,
) -> bool:
    """`plan` exists and beats `than` (None: any plan does) by more than `tolerance` (relative): a lower objective,
    or an equal one with a lower sequential time (unless `tie_break` is off: a caller that gives ties to `than`)."""
    if plan is None:
        return False
    if than is None:
        return True
    mine, theirs = objective(plan, alpha_energy), objective(than, alpha_energy)
    if mine < theirs * (1 - tolerance):
        return True
    tie = mine <= theirs * (1 + tolerance)
    return tie_break and tie and plan.predicted.time_s < than.predicted.time_s * (1 - 1e-12)


def best_of(plans: Sequence[Plan], alpha_energy: float = 0.0) -> Plan | None:
    """The plan `better` than every other (the first of equals), or None."""
    best = None
    for p in plans:
        if better(p, best, alpha_energy):
            best = p
    return best


def objective_floor(
    graph: Graph,
    profile: Profile,
    devices: Sequence[str],
    homes: Mapping[str, str],
    alpha_energy: float = 0.0,
    budgets: Mapping[str, int] | None = None,
) -> tuple[float, str]:
    """No plan's objective is below this: the makespan's lower bound (`time_bound`, under `budgets` in bytes) plus
    alpha x every op's least energy; and what sets it."""
    bound = time_bound(graph, profile, devices, homes, budgets)
    energy = 0.0
    if alpha_energy:
        for o in graph.ops:
            costs = [c.energy_j or 0.0 for d in devices if (c := profile.op_cost(o.id, d)) is not None]
            energy += min(costs, default=0.0)
    return bound.seconds + alpha_energy * energy, bound.why
