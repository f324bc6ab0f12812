"""Park options inside hierarchical blocks (xsched.solve.hier.park): with a store, a block's menu holds schedules
that copy its values out and back, priced by their makespan on the lanes; the H-ILP may also hold a boundary value
on the store. Plans are checked against independent counts (tests/oracle.py) and, executed on cpu:0 with cpu:1 as
the store, against eager PyTorch."""

from __future__ import annotations

import executor_support
import pytest
from oracle import assert_prediction_matches
from oracle import makespan as oracle_makespan
from test_offload import fwd_bwd
from test_park import DEVICES, with_store

from xsched.contracts.plan import Compute, Copy
from xsched.contracts.profile import DeviceInfo, LinkCost, OpCost, Profile
from xsched.solve.hier import HierSettings, solve_hier
from xsched.solve.hier.hierarchy import build_hierarchy
from xsched.solve.hier.leaf import LeafTask, leaf_options
from xsched.solve.hier.park import with_stores
from xsched.solve.hier.region import make_region, sub_profile
from xsched.solve.options import SolverOptions
from xsched.solve.problem import Problem
from xsched.solve.reference import eager_peak

pytestmark = pytest.mark.usefixtures("one_thread")
# deterministic stops: heuristic leaves, H-ILPs to a node limit, no refinement, one process
SETTINGS = HierSettings(max_leaf=4, max_group=2, leaf_s=0, region_s=60, refine=False, workers=1)
OPTIONS = SolverOptions(time_limit_s=120, node_limit=100, hier_processes=1, hier_refine=False)


def counts(g, plan) -> tuple[int, int]:
    """Copies to cpu:1, and computes beyond one per op (recomputes)."""
    copies = sum(isinstance(s, Copy) and s.dst == "cpu:1" for s in plan.steps)
    return copies, sum(isinstance(s, Compute) for s in plan.steps) - len(g.ops)


def test_a_block_menu_offers_park_options_priced_on_the_lanes() -> None:
    """A four-layer block of a chain on cpu:0 with cpu:1 as a store: its menu has a park option that leaves less on
    cpu:0 than the checkpoint option of the same compute, what it parks on cpu:1, and costs its compute time alone
    (the copy moves while the next op runs: 0.11 s against 1 s), not the sequential sum with the copies."""
    g = fwd_bwd(16)
    prof = with_stores(with_store(g, latency=0.01, bandwidth=1000.0))
    block = next(b for b in build_hierarchy(g, 4, 2, 2).blocks if b.leaf and b.b_ops)
    region = make_region(g, block.f_ops, block.b_ops, "block")
    task = LeafTask(region, sub_profile(prof, region.graph), DEVICES, {"x": "cpu:0"}, 0, 12)
    menu = leaf_options(task)
    parked = [o for o in menu if o.label.startswith("park:cpu:1")]
    assert parked, [o.label for o in menu]
    ops = len(region.graph.ops)
    for o in parked:
        steps = [*o.f.steps, *o.b.steps]
        computes = sum(isinstance(s, Compute) for s in steps)
        copies = [s for s in steps if isinstance(s, Copy)]
        assert copies and o.f.left.get("cpu:1", 0) > 0
        assert o.time_s == pytest.approx(computes * 1.0)  # its copies hidden behind compute
        assert o.time_s < computes * 1.0 + 0.11 * len(copies)
        same = [c for c in menu if c.label == "checkpoint" and c.time_s == pytest.approx(ops * 1.0)]
        if computes == ops and same:
            assert o.f.left.get("cpu:0", 0) < min(c.f.left.get("cpu:0", 0) for c in same)


def test_hier_parks_where_the_link_has_room_and_recomputes_without_a_store() -> None:
    """A 16-layer chain at half its eager peak: on cpu:0 alone hier recomputes; with cpu:1 as a store it parks
    instead, recomputes nothing and runs faster (an independent event sweep), within the budget (independent
    counts)."""
    g = fwd_bwd(16)
    prof = with_store(g, latency=0.01, bandwidth=1000.0)
    budgets, homes = {"cpu:0": eager_peak(g) // 2}, {"x": "cpu:0"}
    alone = solve_hier(Problem(g, prof, budgets, ["cpu:0"], homes), OPTIONS, settings=SETTINGS)
    parked = solve_hier(Problem(g, prof, budgets, list(DEVICES), homes), OPTIONS, settings=SETTINGS)
    for plan in (alone, parked):
        assert_prediction_matches(g, plan, prof, budgets)
        assert plan.predicted.makespan_s == pytest.approx(oracle_makespan(g, plan, prof))
    assert counts(g, alone) == (0, counts(g, alone)[1]) and counts(g, alone)[1] > 0
    copies, recomputes = counts(g, parked)
    assert copies > 0 and recomputes == 0
    assert oracle_makespan(g, parked, prof) < oracle_makespan(g, alone, prof)
    assert parked.predicted.makespan_s < parked.predicted.time_s  # the copies overlap the computes


def test_a_hier_plan_that_parks_trains_like_eager(monkeypatch) -> None:
    """gpt2 (tiny, 2 layers) at 60% of its eager peak on cpu:0 with cpu:1 as the store: hier's plan parks values,
    recomputes less than on cpu:0 alone, fits (independent counts), and the executor (step by step with the trace,
    and on its lanes) gives eager's outputs, gradients and buffers."""
    monkeypatch.setitem(executor_support.ZOO, "gpt2", (8, "tiny:n_layer=2", 25, 25))
    _, graph = executor_support.workload("gpt2")
    link = LinkCost(1e-4, 3e8)
    profile = Profile(
        graph.fingerprint,
        {d: DeviceInfo("cpu") for d in DEVICES},
        {"cpu:0": {o.id: OpCost(1e-3) for o in graph.ops}, "cpu:1": {}},
        {"cpu:0->cpu:1": link, "cpu:1->cpu:0": link},
    )
    budgets, homes = {"cpu:0": int(0.6 * eager_peak(graph))}, {v: "cpu:0" for v in graph.inputs}
    settings = HierSettings(leaf_s=0, region_s=60, refine=False, workers=1)
    plan = solve_hier(Problem(graph, profile, budgets, list(DEVICES), homes), OPTIONS, settings=settings)
    alone = solve_hier(Problem(graph, profile, budgets, ["cpu:0"], homes), OPTIONS, settings=settings)
    copies, recomputes = counts(graph, plan)
    assert copies > 0 and recomputes < counts(graph, alone)[1]
    assert_prediction_matches(graph, plan, profile, budgets)
    assert plan.predicted.makespan_s == pytest.approx(oracle_makespan(graph, plan, profile))
    executor_support.check_against_eager("gpt2", plan, trace=True).close()
    executor_support.check_against_eager("gpt2", plan, trace=False, overlap=True).close()
