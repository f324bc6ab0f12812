"""Lean checkpointing (xsched.solve.heuristics.lean, checkpoint.lean_search): its orders are topological, every candidate is a valid plan, and the
window made again at the end remakes its gradients. Plans executed against eager PyTorch: test_executor."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from oracle import peaks as oracle_peaks
from test_heuristics import train_dags

from xsched.contracts.graph import Graph
from xsched.contracts.plan import Compute, ends_on_one_device
from xsched.solve.heuristics import lean
from xsched.solve.heuristics.checkpoint import candidate_keeps, lean_search
from xsched.solve.heuristics.routing import route_and_finish


def is_topological(graph: Graph, order: list[str]) -> bool:
    at = {o: i for i, o in enumerate(order)}
    return sorted(order) == sorted(o.id for o in graph.ops) and all(
        at[graph.producer[v]] < at[o.id] for o in graph.ops for v in o.inputs if v in graph.producer
    )


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(train_dags())
def test_late_gradient_order_is_topological_and_only_moves_gradient_makers_later(g: Graph) -> None:
    homes = {v: "cpu" for v in g.inputs}
    ends = ends_on_one_device(g, homes)
    order = [op.id for op in lean.late_gradient_order(g, ends)]
    assert is_topological(g, order)
    makers = {
        op.id for op in g.ops if op.phase == "bwd" and all(v in ends and not g.consumers.get(v) for v in op.outputs)
    }
    others = [o for o in order if o not in makers]
    assert others == [op.id for op in g.ops if op.id not in makers]  # the rest keep graph order
    for o in makers:  # a gradient maker has at least as many of the rest before it as in graph order
        assert sum(1 for x in order[: order.index(o)] if x not in makers) >= sum(
            1 for op in g.ops[: g.op_index[o]] if op.id not in makers
        )


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(train_dags())
def test_every_candidate_the_search_hands_on_is_a_valid_plan_and_windows_remake_their_gradients(g: Graph) -> None:
    """Each candidate plans and simulates without error (every op computed, inputs resident, gradients at home at
    the end); a candidate with a window recomputes the window's gradient makers after the whole first pass."""
    homes = {v: "cpu" for v in g.inputs}
    seen: list[str] = []

    def consider(label: str, computes: list[Compute]) -> int:
        plan = route_and_finish(g, computes, "lean", {}, homes, None, 0.0)
        assert plan.predicted.peak_bytes["cpu"] == oracle_peaks(g, plan)["cpu"]  # counted independently
        if "window" in label:
            first = len(computes) - int(label.rsplit(" ", 1)[1])
            assert [c.op for c in computes[:first]].count(computes[-1].op) >= 1  # made once before, and again
        seen.append(label)
        return plan.predicted.peak_bytes["cpu"]

    lean_search(g, candidate_keeps(g), "cpu", homes, consider)
    assert any(label.startswith("lean ") for label in seen)
