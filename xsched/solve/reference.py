"""The eager plan: every op once, in graph order, on one device, each value freed after its last use."""

from __future__ import annotations

from xsched.contracts.graph import Graph
from xsched.contracts.plan import Compute, Plan, autograd_boundary, place_frees
from xsched.contracts.profile import Profile
from xsched.contracts.result import SolveResult
from xsched.simulate import simulate


def eager_plan(graph: Graph, device: str = "cpu", profile: Profile | None = None) -> Plan:
    """The plain schedule on `device`; its peak is what budgets written as "50%" refer to."""
    homes = {v: device for v in graph.inputs}
    steps = place_frees(graph, [Compute(o.id, device) for o in graph.ops], homes)
    plan = Plan(
        graph=graph.fingerprint,
        budgets={},
        homes=homes,
        steps=steps,
        solver=SolveResult(f"eager:{device}", "heuristic"),
        boundary=autograd_boundary(graph, steps),
    )
    result = simulate(graph, plan, profile)
    return Plan(**{**plan.__dict__, "predicted": result.prediction()})


def eager_peak(graph: Graph) -> int:
    """Peak bytes of the eager plan on one device."""
    return max(simulate(graph, eager_plan(graph, "dev")).peak_bytes.values(), default=0)
