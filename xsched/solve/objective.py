"""The one objective every solver minimises and ranks plans by, and the lower bound on it that gaps are measured
against. Changing what "better" means is a change here and nowhere else."""

from __future__ import annotations

from collections.abc import Sequence

from xsched.contracts.graph import Graph
from xsched.contracts.plan import Plan
from xsched.contracts.profile import Profile


def objective(plan: Plan, alpha_energy: float = 0.0) -> float:
    """The plan's predicted time + alpha x its predicted energy (seconds)."""
    p = plan.predicted
    assert p is not None, "objective of a plan the simulator has not checked"
    return (p.time_s or 0.0) + alpha_energy * (p.energy_j or 0.0)


def better(plan: Plan | None, than: Plan | None, alpha_energy: float = 0.0) -> bool:
    """`plan` exists and beats `than` (None: any plan does) by more than rounding."""
    if plan is None:
        return False
    return than is None or objective(plan, alpha_energy) < objective(than, alpha_energy) * (1 - 1e-12)


def best_of(plans: Sequence[Plan], alpha_energy: float = 0.0) -> Plan | None:
    """The plan with the least objective (the first of equals), or None."""
    return min(plans, key=lambda p: objective(p, alpha_energy), default=None)


def objective_floor(graph: Graph, profile: Profile, devices: Sequence[str], alpha_energy: float = 0.0) -> float:
    """Every op once on its cheapest device and no copies: no plan in any order does better."""
    total = 0.0
    for o in graph.ops:
        costs = [c for d in devices if (c := profile.op_cost(o.id, d)) is not None]
        total += min((c.time_s + alpha_energy * (c.energy_j or 0.0) for c in costs), default=0.0)
    return total
