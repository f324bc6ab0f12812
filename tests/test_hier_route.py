"""hier routes as the heuristics do: its flattened plans (hextract.finish_plan) issue each copy home (a gradient to
its parameter's home) as its value is made where that fits and is faster (routing.with_early_homes; at the end of the
plan it waits for the computes and frees before it on its home, xsched.lanes, and runs in a tail), and its blocks'
plans bring a value through a chain of links where none is direct. Plans are checked against the independent counts
of tests/oracle.py, the makespan against a hand count."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from oracle import assert_prediction_matches, resident_at_end
from oracle import makespan as oracle_makespan
from oracle import peaks as oracle_peaks
from test_heuristics import train_dags
from test_park_route import links_dropped
from test_park_three import DEVICES
from test_route_home_copies import HOMES, gradient_before_the_homes_own_work

import xsched.solve.hier.solver as hier_solver
from xsched.contracts.graph import Graph, Op, Value
from xsched.contracts.plan import Compute, Copy
from xsched.contracts.profile import DeviceInfo, LinkCost, OpCost, Profile
from xsched.contracts.result import SolveResult
from xsched.errors import BudgetError, NoIncumbent, XschedError
from xsched.simulate import simulate
from xsched.solve.hier import HierSettings, solve_hier
from xsched.solve.hier.hextract import finish_plan
from xsched.solve.options import SolverOptions
from xsched.solve.problem import Problem
from xsched.solve.registry import SOLVERS, run_member

pytestmark = pytest.mark.usefixtures("one_thread")

# a schedule as hier's extraction makes it: o0, o1 on a, o2, o3 on b (p1's home), g1's copy home in the last stage
STEPS = (
    Copy("p1", "b", "a"),
    Compute("o0", "a"),
    Compute("o1", "a"),
    Compute("o2", "b"),
    Compute("o3", "b"),
    Copy("g1", "a", "b"),
)
ENDS = {("g1", "b"), ("z", "b")}


def test_the_flattened_plan_sends_a_gradient_home_while_its_home_computes() -> None:
    """By hand (test_route_home_copies' graph): p1's copy 0-0.2 s, o0 0.2-1.2 s, o1 1.2-2.2 s on a; o2 0-1.5 s, o3
    1.5-3 s on b. g1's copy home (1.1 s) moved right after o1 runs 2.2-3.3 s, 3.3 s; main left it last, behind o3 and
    w's free on b: 3-4.1 s."""
    g, profile = gradient_before_the_homes_own_work()
    plan = finish_plan(g, profile, STEPS, {}, HOMES, ENDS, SolveResult("hier", "feasible"))
    assert_prediction_matches(g, plan, profile)
    kept = [s for s in plan.steps if isinstance(s, Copy | Compute)]
    assert kept.index(Copy("g1", "a", "b")) == kept.index(Compute("o1", "a")) + 1
    assert ENDS <= resident_at_end(g, plan)
    assert plan.solver.method == "hier"
    assert oracle_makespan(g, plan, profile) == pytest.approx(3.3)
    assert plan.predicted.makespan_s == pytest.approx(3.3)


def test_the_flattened_plans_copy_home_stays_last_where_early_would_overfill_the_home() -> None:
    """b at 120 B: early, g1 is on b with p1, w and z (165 B); last, w is freed first (115 B), 4.1 s by hand."""
    g, profile = gradient_before_the_homes_own_work()
    budgets = {"b": 120}
    plan = finish_plan(g, profile, STEPS, budgets, HOMES, ENDS, SolveResult("hier", "feasible"))
    assert_prediction_matches(g, plan, profile, budgets)
    assert [s for s in plan.steps if isinstance(s, Copy | Compute)][-1] == Copy("g1", "a", "b")
    assert oracle_peaks(g, plan, profile)["b"] == 115
    assert oracle_makespan(g, plan, profile) == pytest.approx(4.1)


def weight_two_links_away() -> tuple[Graph, Profile]:
    """o0 (reads p1 and x0, makes x1), o1 (backward: x1 -> g1, p1's gradient) and o2 (backward: x1 -> d), 1 s each,
    run only on a; p1 homed on the store c, linked only to the store b, which is linked to a (0.1 s + 100 B/s each
    way, 10 B values: 0.2 s a copy)."""
    values = (
        Value("p1", 10, "param"),
        Value("x0", 10, "input"),
        Value("x1", 10),
        Value("g1", 10, grad_of="p1"),
        Value("d", 10),
    )
    ops = (
        Op("o0", "t", ("p1", "x0"), ("x1",)),
        Op("o1", "t", ("x1",), ("g1",), phase="bwd"),
        Op("o2", "t", ("x1",), ("d",), phase="bwd"),
    )
    g = Graph("relay", values, ops, ("g1", "d"))
    link = LinkCost(0.1, 100.0)
    costs = {"a": {o.id: OpCost(1.0) for o in ops}}
    links = {"a->b": link, "b->a": link, "b->c": link, "c->b": link}
    return g, Profile(g.fingerprint, {d: DeviceInfo("cpu") for d in "abc"}, costs, links, stores=("b", "c"))


@pytest.mark.parametrize("hilp", [True, False], ids=["hilp", "no-solver-plan"])
def test_a_block_brings_a_weight_through_a_relay(hilp: bool, monkeypatch) -> None:
    """p1 goes c -> b -> a (0-0.4 s), o0, o1, o2 run 0.4-3.4 s, and g1 goes home a -> b -> c while o2 runs: 3.4 s by
    hand. Main's blocks routed over direct links only: BudgetError 'not found' for a problem check_budgets lets
    through. Without the H-ILP's plan, the no-solver plan (direct_plan) is the same."""
    g, profile = weight_two_links_away()
    if not hilp:

        def no_hilp(*args, **kwargs):
            raise XschedError("no H-ILP plan in this test", stage="solve")

        monkeypatch.setattr(hier_solver, "solve_hilp", no_hilp)
    settings = HierSettings(max_leaf=2, leaf_s=0, region_s=2, workers=1, refine=False)
    homes = {"p1": "c", "x0": "a"}
    plan = solve_hier(
        Problem(g, profile, {}, ("a", "b", "c"), homes), SolverOptions(time_limit_s=10), settings=settings
    )
    assert_prediction_matches(g, plan, profile)
    assert plan.solver.stats.top.startswith("hilp" if hilp else "fast")
    copies = [s for s in plan.steps if isinstance(s, Copy)]
    assert copies == [Copy("p1", "c", "b"), Copy("p1", "b", "a"), Copy("g1", "a", "b"), Copy("g1", "b", "c")]
    assert {("g1", "c"), ("d", "a")} <= resident_at_end(g, plan)
    assert oracle_makespan(g, plan, profile) == pytest.approx(3.4)


def test_with_links_missing_hiers_plans_are_valid_and_none_beats_a_proof() -> None:
    """test_park_route's sweep for hier: random training graphs on a, b, c, each link dropped at random, random homes,
    a budget on a in some draws. No plan where check_reach proves none, every plan valid (simulator, independent
    counts, event sweep), no error but BudgetError or NoIncumbent; some draws plan (25 derandomized draws: 16 here,
    4 on main, whose blocks routed over direct links only)."""
    planned: list[bool] = []

    @settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
    @given(train_dags(max_ops=5), st.data())
    def draw(g: Graph, data) -> None:
        profile, homes, budgets, no_plan = links_dropped(g, data)
        options = SolverOptions(time_limit_s=5, hier_processes=1)
        r = run_member(SOLVERS["hier"], Problem(g, profile, budgets, DEVICES, homes), options, None)
        planned.append(r.plan is not None)
        if r.plan is None:
            assert isinstance(r.error, BudgetError | NoIncumbent), r.error
            return
        assert not no_plan, "hier planned what check_reach proved impossible"
        simulate(g, r.plan, profile)
        assert_prediction_matches(g, r.plan, profile, budgets)
        assert r.plan.predicted.makespan_s == pytest.approx(oracle_makespan(g, r.plan, profile))

    draw()
    assert any(planned)
