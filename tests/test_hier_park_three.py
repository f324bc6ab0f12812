"""Hier's park options with three computing devices and a store: random homes (the store's and a third device's
included), budgets on one or two computing devices. Plans are checked by the simulator and against independent
counts and an event sweep (tests/oracle.py); one, executed on cpu:0, cpu:1 and cpu:2 with cpu:3 as the store, gives
eager PyTorch's outputs, gradients and buffers. Inputs homed over a budget are refused, not planned over it."""

from __future__ import annotations

import executor_support
import pytest
from oracle import assert_prediction_matches, resident_at_end
from oracle import makespan as oracle_makespan
from test_offload import fwd_bwd
from test_park_three import sweep_three_devices, three_devices

from xsched.contracts.graph import Graph, Op, Value
from xsched.contracts.plan import Copy
from xsched.contracts.profile import DeviceInfo, LinkCost, OpCost, Profile
from xsched.errors import BudgetError, NoIncumbent
from xsched.simulate import simulate
from xsched.solve.hier import HierSettings, solve_hier
from xsched.solve.hier import solver as hier_solver
from xsched.solve.options import SolverOptions
from xsched.solve.problem import Problem
from xsched.solve.reference import eager_peak

pytestmark = pytest.mark.usefixtures("one_thread")

DEVICES = ("a", "b", "c", "s")  # s runs no op: the store
# deterministic stops: heuristic leaves, H-ILPs to a node limit, no refinement, one process
SETTINGS = HierSettings(max_leaf=2, max_group=2, leaf_s=0, region_s=10, refine=False, workers=1)
OPTIONS = SolverOptions(time_limit_s=30, node_limit=50, hier_processes=1, hier_refine=False)


def three_and_a_store(g: Graph, b_s: float = 0.5, bandwidth: float = 1.0) -> Profile:
    """test_park_three's three devices (a 1 s an op, b `b_s`, c 2 s) and the store s, every pair linked."""
    return three_devices(g, b_s, bandwidth, store="s")


def test_every_three_device_hier_plan_with_a_store_is_valid_or_none_is_found() -> None:
    """Random training graphs: each hier plan valid (simulator, independent counts, event sweep) with every output
    where it must end, or BudgetError / NoIncumbent; at least a fifth of the draws give a plan (few of these small
    graphs park: the chains below do)."""

    def gradients_home(g: Graph, plan, homes: dict[str, str]) -> None:
        end = resident_at_end(g, plan)
        assert all((f"g_{p}", homes[p]) in end for p in g.inputs if f"g_{p}" in g.value)

    def hier(problem: Problem):  # noqa: ANN202
        return solve_hier(problem, OPTIONS, settings=SETTINGS)

    sweep_three_devices(hier, 30, store="s", no_plan=(BudgetError, NoIncumbent), also=gradients_home)


@pytest.mark.parametrize("home, limited", [("a", "ab"), ("c", "ab"), ("s", "b")])
def test_hier_parks_an_eight_layer_chain_on_the_store_beside_three_devices(home: str, limited: str) -> None:
    """An 8-layer chain, its input homed on `home`, each of `limited` at half the eager peak: hier's plan parks a
    value on s (copied there and back), within the budgets (independent counts), its makespan the event sweep's."""
    g = fwd_bwd(8)
    profile = three_and_a_store(g, bandwidth=1000.0)
    budgets = {d: eager_peak(g) // 2 for d in limited}
    chain = HierSettings(max_leaf=4, max_group=2, leaf_s=0, region_s=60, refine=False, workers=1)
    plan = solve_hier(Problem(g, profile, budgets, list(DEVICES), {"x": home}), OPTIONS, settings=chain)
    simulate(g, plan, profile)
    assert_prediction_matches(g, plan, profile, budgets)
    assert plan.predicted.makespan_s == pytest.approx(oracle_makespan(g, plan, profile))
    to_store = {s.value for s in plan.steps if isinstance(s, Copy) and s.dst == "s"}
    assert any(isinstance(s, Copy) and s.src == "s" and s.value in to_store for s in plan.steps)


def homed_over_budget() -> tuple[Graph, Profile]:
    """Three ops on whatever device; in0 (4 B) homed on a, whose budget will be 0; v0_0 has no bytes (found by a
    random sweep: the H-ILP's memory row for a was a constant, which Pyomo refused as trivially infeasible)."""
    values = (
        Value("in0", 4, "input"),
        Value("p0", 1, "param"),
        Value("v0_0", 0),
        Value("v1_0", 1),
        Value("g_p0", 1, grad_of="p0"),
    )
    ops = (
        Op("o0", "t", ("p0", "in0"), ("v0_0",), workspace_bytes=2),
        Op("o1", "t", (), ("v1_0",)),
        Op("grad_p0", "t", ("in0",), ("g_p0",), phase="bwd"),
    )
    g = Graph("rand", values, ops, ("v0_0", "g_p0"))
    return g, three_and_a_store(g)


# at 5 B the homes alone fit, but g_p0 (1 B) must end on a too (p0 lives there): check_budgets' bound, not theirs
@pytest.mark.parametrize("budget", [0, 5])
def test_inputs_homed_over_a_budget_are_refused_as_proven(budget: int) -> None:
    """Homes and the outputs that must end beside them (6 B) over a's budget: a proven BudgetError from
    check_budgets' lower bound naming a, before any level is solved (the simulator checks budgets where steps
    allocate, so a plan that never allocates on a would have passed it)."""
    g, profile = homed_over_budget()
    problem = Problem(g, profile, {"a": budget}, list(DEVICES), {"in0": "a", "p0": "a"})
    why = "5 B of graph inputs homed on a \\+ 1 B of outputs that must end there"
    pattern = rf"hier: no plan, proven: budget {budget} B on a is below the lower bound 6 B: {why}\."
    with pytest.raises(BudgetError, match=pattern) as e:
        solve_hier(problem, OPTIONS, settings=SETTINGS)
    assert e.value.device == "a"


def test_the_h_ilp_refuses_homes_over_a_budget_with_an_error_of_its_own(monkeypatch) -> None:
    """Past that check (as a block's H-ILP at a grid budget is), the H-ILP says no plan instead of letting Pyomo
    raise on its constant memory row."""
    monkeypatch.setattr(hier_solver, "check_budgets", lambda *args: None)
    g, profile = homed_over_budget()
    problem = Problem(g, profile, {"a": 0}, list(DEVICES), {"in0": "a", "p0": "a"})
    with pytest.raises(NoIncumbent, match="the inputs homed on a exceed its budget alone"):
        solve_hier(problem, OPTIONS, settings=SETTINGS)


def test_a_hier_plan_on_three_devices_and_a_store_trains_like_eager(monkeypatch) -> None:
    """gpt2 (tiny, 2 layers): data on cpu:0, weights on cpu:2, cpu:1 computing too (slower), cpu:3 the store, cpu:0
    at 60% of its eager peak. Hier's plan parks on cpu:3, fits (independent counts), sends every gradient home to
    cpu:2, and the executor (step by step with the trace, and on its lanes) gives eager's outputs, gradients and
    buffers."""
    monkeypatch.setitem(executor_support.ZOO, "gpt2", (8, "tiny:n_layer=2", 25, 25))
    _, graph = executor_support.workload("gpt2")
    devices = ("cpu:0", "cpu:1", "cpu:2", "cpu:3")
    link = LinkCost(1e-4, 3e8)
    profile = Profile(
        graph.fingerprint,
        {d: DeviceInfo("cpu") for d in devices},
        {
            "cpu:0": {o.id: OpCost(1e-3) for o in graph.ops},
            "cpu:1": {o.id: OpCost(4e-3) for o in graph.ops},
            "cpu:2": {o.id: OpCost(4e-3) for o in graph.ops},
            "cpu:3": {},
        },
        {f"{x}->{y}": link for x in devices for y in devices if x != y},
    )
    homes = {v: "cpu:2" if graph.value[v].kind in ("param", "buffer") else "cpu:0" for v in graph.inputs}
    budgets = {"cpu:0": int(0.6 * eager_peak(graph))}
    settings_ = HierSettings(leaf_s=0, region_s=60, refine=False, workers=1)
    plan = solve_hier(Problem(graph, profile, budgets, list(devices), homes), OPTIONS, settings=settings_)
    assert any(isinstance(s, Copy) and s.dst == "cpu:3" for s in plan.steps)
    assert_prediction_matches(graph, plan, profile, budgets)
    assert plan.predicted.makespan_s == pytest.approx(oracle_makespan(graph, plan, profile))
    end = resident_at_end(graph, plan)
    assert all((g, "cpu:2") in end for g in graph.outputs if graph.value[g].grad_of)
    executor_support.check_against_eager("gpt2", plan, trace=True).close()
    executor_support.check_against_eager("gpt2", plan, trace=False, overlap=True).close()
