"""Park's copies home (a gradient to its parameter's home on the store) are issued as each gradient is made, not left
at the end of the plan: there they queue behind the store's free of a value parked and copied back late in the
backward, and run in a tail after the last compute. Plans are checked by the simulator and against independent
counts and an event sweep (tests/oracle.py); the makespan against a hand count."""

from __future__ import annotations

import pytest
from oracle import assert_prediction_matches, resident_at_end
from oracle import makespan as oracle_makespan
from oracle import peaks as oracle_peaks

from xsched.contracts.graph import Graph, Op, Value
from xsched.contracts.plan import Compute, Copy
from xsched.contracts.profile import DeviceInfo, LinkCost, OpCost, Profile
from xsched.simulate import simulate
from xsched.solve.heuristics.park import park_remat, park_variant
from xsched.solve.heuristics.park_model import ParkTimeline
from xsched.solve.problem import Problem

pytestmark = pytest.mark.usefixtures("one_thread")
DEVICES = ("a", "b")
HOMES = {"p0": "b", "p1": "b"}


def late_park_before_the_last_gradient() -> tuple[Graph, Profile]:
    """Six ops on a, 1 s each, in their one order but for o4. Forward: o0 makes x (40 B), o1 reads x and makes s (5
    B), o2 reads s and makes h (40 B). Backward: o3 reads h and makes g1 (200 B, the gradient of p1), o4 makes u (5
    B), o5 reads x, u and g1 and makes g0 (10 B, the gradient of p0). p0 and p1 live on b, the store (which runs no
    op), and are never read on a. Both links 0.1 s + 100 B/s."""
    values = (
        Value("p0", 10, "param"),
        Value("p1", 10, "param"),
        Value("x", 40),
        Value("s", 5),
        Value("h", 40),
        Value("g1", 200, grad_of="p1"),
        Value("u", 5),
        Value("g0", 10, grad_of="p0"),
    )
    ops = (
        Op("o0", "t", (), ("x",)),
        Op("o1", "t", ("x",), ("s",)),
        Op("o2", "t", ("s",), ("h",)),
        Op("o3", "t", ("h",), ("g1",), phase="bwd"),
        Op("o4", "t", (), ("u",), phase="bwd"),
        Op("o5", "t", ("x", "u", "g1"), ("g0",), phase="bwd"),
    )
    g = Graph("hand", values, ops, ("g1", "g0"))
    link = LinkCost(0.1, 100.0)
    return g, Profile(
        g.fingerprint,
        {d: DeviceInfo("cpu") for d in DEVICES},
        {"a": {o.id: OpCost(1.0) for o in g.ops}, "b": {}},
        {"a->b": link, "b->a": link},
    )


def test_gradients_go_home_while_the_backward_runs() -> None:
    """a at 255 B. Held to the end, g1 makes o3's position 280 B (x, h, g1), so x is parked on b across o1-o4 and
    copied back for o5 (o5's 255 B: x, g1, u, g0). By hand: the computes run back to back, 0-6 s (x's copy out
    1-1.5 s, after o0, done before o2's start; its copy back 4-4.5 s, issued after o3, done by o5's start). g1 goes
    home as it is made: 4-6.1 s (2.1 s), then g0 after o5 and behind g1 on the lane, 6.1-6.3 s: 6.3 s. Main issued
    both copies home at the end, where they wait for b's free of x after its copy back (4.5 s): g1 4.5-6.6 s, g0
    6.6-6.8 s, 6.8 s."""
    g, profile = late_park_before_the_last_gradient()
    budgets = {"a": 255}
    plan = park_variant(g, profile, budgets, HOMES, "a", "b", "graph", tuple(range(6)), 0, 0.0, 1.0, 0.0)
    simulate(g, plan, profile)
    assert_prediction_matches(g, plan, profile, budgets)
    copies = [s for s in plan.steps if isinstance(s, Copy)]
    assert copies == [Copy("x", "a", "b"), Copy("g1", "a", "b"), Copy("x", "b", "a"), Copy("g0", "a", "b")]
    # g1's copy home comes right after its compute, before the rest of the backward
    kept = [s for s in plan.steps if isinstance(s, Copy | Compute)]
    assert kept.index(Copy("g1", "a", "b")) == kept.index(Compute("o3", "a")) + 1
    assert {("g1", "b"), ("g0", "b")} <= resident_at_end(g, plan)
    assert oracle_peaks(g, plan, profile)["a"] == 255
    assert oracle_makespan(g, plan, profile) == pytest.approx(6.3)
    assert plan.predicted.makespan_s == pytest.approx(6.3)
    # the method's entry point finds it too
    best = park_remat(Problem(g, profile, budgets, list(DEVICES), HOMES))
    assert_prediction_matches(g, best, profile, budgets)
    assert oracle_makespan(g, best, profile) == pytest.approx(6.3)


def test_copies_home_stay_at_the_end_where_early_ones_would_overfill_the_home() -> None:
    """The same with b at 240 B. Issued early, g1 lands on b (4-6.1 s) before the plan frees x there after its copy
    back: p0, p1, x and g1 make 260 B on b. At the end, x is freed first: b holds at most p0, p1, g1 and g0 (230 B),
    and the plan is main's, 6.8 s by the count above."""
    g, profile = late_park_before_the_last_gradient()
    budgets = {"a": 255, "b": 240}
    plan = park_variant(g, profile, budgets, HOMES, "a", "b", "graph", tuple(range(6)), 0, 0.0, 1.0, 0.0)
    simulate(g, plan, profile)
    assert_prediction_matches(g, plan, profile, budgets)
    copies = [s for s in plan.steps if isinstance(s, Copy)]
    assert copies == [Copy("x", "a", "b"), Copy("x", "b", "a"), Copy("g1", "a", "b"), Copy("g0", "a", "b")]
    assert oracle_peaks(g, plan, profile)["b"] == 230
    assert oracle_makespan(g, plan, profile) == pytest.approx(6.8)


def test_the_timeline_queues_the_copies_home_and_a_park_leaves_with_its_own() -> None:
    """Park's timeline on seven ops, 1 s each (o0 forward, the rest backward): o0 makes x (10 B); o1 reads x and makes
    g1 (200 B, p1's gradient); o2 reads x and makes y (40 B); o3, o4, o5 make z, z2, z3 (5 B) in a chain; o6 reads
    y, g1 and z3 and makes g0 (10 B, p0's gradient). The copies home wait on the out lane in making order: g1's (2.1
    s) emitted after o1, g0's (0.2 s) after o6, both due by the end. Parking y across o3-o5 at o3: its copy out,
    ready when o2 ends (3 s), runs behind g1's (2-4.1 s), 4.1-4.6 s, so o3 (from 3 s) waits 1.6 s for y's free
    (main counted 0.5 s: an empty lane); y comes back 5-5.5 s, in time for o6. Parking g1 across o2-o5 leaves with
    its copy home: the lane holds one copy of g1, due where g1 is freed."""
    values = (
        Value("p0", 10, "param"),
        Value("p1", 10, "param"),
        Value("x", 10),
        Value("g1", 200, grad_of="p1"),
        Value("y", 40),
        Value("z", 5),
        Value("z2", 5),
        Value("z3", 5),
        Value("g0", 10, grad_of="p0"),
    )
    ops = (
        Op("o0", "t", (), ("x",)),
        Op("o1", "t", ("x",), ("g1",), phase="bwd"),
        Op("o2", "t", ("x",), ("y",), phase="bwd"),
        Op("o3", "t", (), ("z",), phase="bwd"),
        Op("o4", "t", ("z",), ("z2",), phase="bwd"),
        Op("o5", "t", ("z2",), ("z3",), phase="bwd"),
        Op("o6", "t", ("y", "g1", "z3"), ("g0",), phase="bwd"),
    )
    g = Graph("hand", values, ops, ("g1", "g0"))
    link = LinkCost(0.1, 100.0)
    profile = Profile(
        g.fingerprint,
        {d: DeviceInfo("cpu") for d in DEVICES},
        {"a": {o.id: OpCost(1.0) for o in g.ops}, "b": {}},
        {"a->b": link, "b->a": link},
    )
    line = ParkTimeline(g, range(7), "a", profile, "b", link, link, HOMES)
    assert line.lanes["out"].items == [(1, 2, pytest.approx(2.1), 7), (6, 7, pytest.approx(0.2), 7)]
    pk = line.park("y", 0, 3, 0.0)
    assert (pk.out, pk.q, pk.p, pk.b) == (True, 3, 5, 6)
    assert pk.stall == pytest.approx(1.6)
    pk = line.park("g1", 0, 3, 0.0)
    line.apply_park(pk)
    assert "g1" not in line.home_out
    assert line.lanes["out"].items == [(1, 2, pytest.approx(2.1), pk.q), (6, 7, pytest.approx(0.2), 7)]
