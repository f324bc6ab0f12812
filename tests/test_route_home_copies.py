"""The heuristics that route their plan (route_and_finish, finish_with_early_homes) issue each copy home (a gradient
to its parameter's home) as its value is made where that is faster and fits, not only at the end of the plan: there
a copy waits for the compute and the frees before it on its home (xsched.lanes) and can run in a tail after the last
compute. Plans are checked by the simulator and against the independent counts of tests/oracle.py; the makespan
against a hand count."""

from __future__ import annotations

import pytest
from oracle import assert_prediction_matches, resident_at_end
from oracle import makespan as oracle_makespan
from oracle import peaks as oracle_peaks

from xsched.contracts.graph import Graph, Op, Value
from xsched.contracts.plan import Compute, Copy
from xsched.contracts.profile import DeviceInfo, LinkCost, OpCost, Profile
from xsched.solve.heuristics.fastest import fastest
from xsched.solve.problem import Problem

pytestmark = pytest.mark.usefixtures("one_thread")
HOMES = {"p1": "b"}


def gradient_before_the_homes_own_work() -> tuple[Graph, Profile]:
    """Four ops. On a: o0 reads p1 (10 B, homed on b) and makes x (10 B); o1 (backward) reads x and makes g1 (100 B,
    p1's gradient), 1 s each. On b, which runs only these: o2 reads p1 and makes w (50 B), o3 reads w and makes z (5
    B, a graph output), 1.5 s each. Both links 0.1 s + 100 B/s."""
    values = (
        Value("p1", 10, "param"),
        Value("x", 10),
        Value("g1", 100, grad_of="p1"),
        Value("w", 50),
        Value("z", 5),
    )
    ops = (
        Op("o0", "t", ("p1",), ("x",)),
        Op("o1", "t", ("x",), ("g1",), phase="bwd"),
        Op("o2", "t", ("p1",), ("w",), phase="bwd"),
        Op("o3", "t", ("w",), ("z",), phase="bwd"),
    )
    g = Graph("hand", values, ops, ("g1", "z"))
    link = LinkCost(0.1, 100.0)
    return g, Profile(
        g.fingerprint,
        {d: DeviceInfo("cpu") for d in ("a", "b")},
        {"a": {"o0": OpCost(1.0), "o1": OpCost(1.0)}, "b": {"o2": OpCost(1.5), "o3": OpCost(1.5)}},
        {"a->b": link, "b->a": link},
    )


def test_a_gradient_goes_home_while_its_home_computes() -> None:
    """fastest runs o0, o1 on a and o2, o3 on b. By hand: p1's copy to a 0-0.2 s, o0 0.2-1.2 s, o1 1.2-2.2 s; b runs
    o2 0-1.5 s and o3 1.5-3 s. g1's copy home (1.1 s) issued after o1, before b's computes in the plan, waits for
    nothing on b: 2.2-3.3 s, 3.3 s. merge11b left it at the end of the plan, behind o3 and w's free on b: 3-4.1 s,
    4.1 s."""
    g, profile = gradient_before_the_homes_own_work()
    plan = fastest(Problem(g, profile, {}, ("a", "b"), HOMES))
    assert_prediction_matches(g, plan, profile)
    kept = [s for s in plan.steps if isinstance(s, Copy | Compute)]
    assert kept.index(Copy("g1", "a", "b")) == kept.index(Compute("o1", "a")) + 1
    assert {("g1", "b"), ("z", "b")} <= resident_at_end(g, plan)
    # on b in plan order: p1 and g1 (110 B), o2's w (160 B), o3's z (165 B)
    assert oracle_peaks(g, plan, profile)["b"] == 165
    assert oracle_makespan(g, plan, profile) == pytest.approx(3.3)
    assert plan.predicted.makespan_s == pytest.approx(3.3)


def test_the_copy_home_stays_at_the_end_where_early_would_overfill_the_home() -> None:
    """The same with b at 120 B: issued early, g1 is on b with p1, w and z (165 B). At the end w is freed first: b
    holds at most p1, g1 and z (115 B), and the plan is the one with its copy at the end, 4.1 s by the count above."""
    g, profile = gradient_before_the_homes_own_work()
    budgets = {"b": 120}
    plan = fastest(Problem(g, profile, budgets, ("a", "b"), HOMES))
    assert_prediction_matches(g, plan, profile, budgets)
    assert isinstance(plan.steps[-2], Copy) and plan.steps[-2].value == "g1"  # then g1's free on a
    assert oracle_peaks(g, plan, profile)["b"] == 115
    assert oracle_makespan(g, plan, profile) == pytest.approx(4.1)
