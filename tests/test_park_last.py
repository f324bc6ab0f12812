"""Park lowering a peak at the last position of its order: no span runs past it, but an output that may end on the
store can leave for good before it. Plans are checked by the simulator and against independent counts and an event
sweep (tests/oracle.py)."""

from __future__ import annotations

import pytest
from oracle import assert_prediction_matches, resident_at_end
from oracle import makespan as oracle_makespan
from oracle import peaks as oracle_peaks

from xsched.contracts.graph import Graph, Op, Value
from xsched.contracts.plan import Compute, Copy
from xsched.contracts.profile import DeviceInfo, LinkCost, OpCost, Profile
from xsched.errors import BudgetError
from xsched.simulate import simulate
from xsched.solve.heuristics.park import park_remat, park_variant
from xsched.solve.problem import Problem

pytestmark = pytest.mark.usefixtures("one_thread")
DEVICES = ("a", "b")


def peak_at_the_end(w_read_last: bool = False) -> tuple[Graph, Profile]:
    """Three ops on a, 1 s each, in their one order: o0 makes w (20 B, an output), o1 reads w and makes x (30 B), o2
    reads x (and w if `w_read_last`) and makes y (30 B, an output): 20, 50, 80 B by position. b is the store; both
    links 0.1 s + 10 B/s (w's copy takes 2.1 s)."""
    values = (Value("w", 20), Value("x", 30), Value("y", 30))
    ops = (
        Op("o0", "t", (), ("w",)),
        Op("o1", "t", ("w",), ("x",)),
        Op("o2", "t", ("x", "w") if w_read_last else ("x",), ("y",)),
    )
    g = Graph("hand", values, ops, ("w", "y"))
    link = LinkCost(0.1, 10.0)
    return g, Profile(
        g.fingerprint,
        {d: DeviceInfo("cpu") for d in DEVICES},
        {d: {o.id: OpCost(1.0) for o in g.ops} for d in DEVICES},
        {"a->b": link, "b->a": link},
    )


def test_an_output_leaves_for_good_before_a_peak_at_the_end() -> None:
    """a at 60 B: the peak is o2's 80 B, at the last position, where no value's span runs past it (main found no
    move there). w, an output read last by o1, is parked on b for good. By hand: its copy runs 1-3.1 s after o0, o1
    1-2 s, o2 waits for w's free (3.1-4.1 s): 4.1 s, a's peak x + y at o2 (60 B), w on b at the end."""
    g, profile = peak_at_the_end()
    budgets = {"a": 60}
    plan = park_variant(g, profile, budgets, {}, "a", "b", "graph", (0, 1, 2), 0, 0.0, 1.0, 0.0)
    simulate(g, plan, profile)
    assert_prediction_matches(g, plan, profile, budgets)
    assert [s for s in plan.steps if isinstance(s, Copy | Compute)] == [
        Compute("o0", "a"),
        Copy("w", "a", "b"),
        Compute("o1", "a"),
        Compute("o2", "a"),
    ]
    assert ("w", "b") in resident_at_end(g, plan) and ("w", "a") not in resident_at_end(g, plan)
    assert oracle_makespan(g, plan, profile) == pytest.approx(4.1)
    assert plan.predicted.makespan_s == pytest.approx(4.1)
    assert oracle_peaks(g, plan, profile)["a"] == 60
    budgets = {"a": 60, "b": 60}
    plan = park_remat(Problem(g, profile, budgets, list(DEVICES), {}))
    simulate(g, plan, profile)
    assert_prediction_matches(g, plan, profile, budgets)


def test_a_value_read_at_the_last_position_cannot_leave() -> None:
    """The same with o2 reading w too: all 80 B are needed at o2 (what it reads and makes), so nothing can lower the
    peak, and park says where, on either device (the method's entry point tries both as the compute device)."""
    g, profile = peak_at_the_end(w_read_last=True)
    with pytest.raises(BudgetError, match="cannot lower the peak at o2"):
        park_variant(g, profile, {"a": 60}, {}, "a", "b", "graph", (0, 1, 2), 0, 0.0, 1.0, 0.0)
    with pytest.raises(BudgetError, match="cannot lower the peak at o2"):
        park_remat(Problem(g, profile, {"a": 60, "b": 60}, list(DEVICES), {}))


def test_a_gradient_goes_straight_home_before_a_peak_at_the_end() -> None:
    """The same order with w the gradient of p0 (homed on c, never read on a), every op backward, b the store and a
    link a->c twice as fast (0.1 s + 20 B/s): w leaves for good straight home, its copy 1-2.1 s, o2 waits for its
    free (2.1-3.1 s): 3.1 s, a's peak x + y (60 B), w on c at the end. Main found no plan (100 B at o2, p0 counted)."""
    devices = ("a", "b", "c")
    values = (Value("p0", 20, "param"), Value("w", 20, grad_of="p0"), Value("x", 30), Value("y", 30))
    ops = (
        Op("o0", "t", (), ("w",), phase="bwd"),
        Op("o1", "t", ("w",), ("x",), phase="bwd"),
        Op("o2", "t", ("x",), ("y",), phase="bwd"),
    )
    g = Graph("hand", values, ops, ("w", "y"))
    slow, fast = LinkCost(0.1, 10.0), LinkCost(0.1, 20.0)
    links = {f"{x}->{y}": fast if (x, y) == ("a", "c") else slow for x in devices for y in devices if x != y}
    costs = {d: {o.id: OpCost(1.0) for o in g.ops} for d in devices}
    profile = Profile(g.fingerprint, {d: DeviceInfo("cpu") for d in devices}, costs, links)
    budgets = {"a": 60}
    plan = park_variant(g, profile, budgets, {"p0": "c"}, "a", "b", "graph", (0, 1, 2), 0, 0.0, 1.0, 0.0)
    simulate(g, plan, profile)
    assert_prediction_matches(g, plan, profile, budgets)
    assert [s for s in plan.steps if isinstance(s, Copy)] == [Copy("w", "a", "c")]
    assert ("w", "c") in resident_at_end(g, plan) and ("w", "a") not in resident_at_end(g, plan)
    assert oracle_makespan(g, plan, profile) == pytest.approx(3.1)
    assert oracle_peaks(g, plan, profile)["a"] == 60
