"""Park with three computing devices. The regression: a gradient homed on a third device (neither the compute
device nor the store) was parked for good on the store, and routing then copied it home from the compute device,
where the park had freed it. Now its copy home leaves from the store, or the park sends it straight home where that
frees the compute device sooner. Plans are checked by the simulator and against independent counts and an event
sweep (tests/oracle.py)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from oracle import assert_prediction_matches, resident_at_end
from oracle import makespan as oracle_makespan
from oracle import peaks as oracle_peaks
from test_heuristics import train_dags

from xsched.contracts.graph import Graph, Op, Value
from xsched.contracts.plan import Copy, Plan
from xsched.contracts.profile import DeviceInfo, LinkCost, OpCost, Profile
from xsched.errors import BudgetError
from xsched.simulate import simulate
from xsched.solve import SolverOptions, solve
from xsched.solve.heuristics.park import park_remat, park_variant
from xsched.solve.heuristics.park_model import ParkTimeline
from xsched.solve.order.order import starting_orders
from xsched.solve.problem import Problem
from xsched.solve.reference import eager_peak

pytestmark = pytest.mark.usefixtures("one_thread")
DEVICES = ("a", "b", "c")


def three_devices(g: Graph, b_s: float = 0.5, bandwidth: float = 1.0, store: str | None = None) -> Profile:
    """a runs every op in 1 s, b in `b_s`, c in 2 s, `store` (if given) none; every pair linked both ways (0.1 s
    latency, `bandwidth` B/s)."""
    seconds = {"a": 1.0, "b": b_s, "c": 2.0}
    devices = (*DEVICES, *([store] if store else []))
    link = LinkCost(0.1, bandwidth)
    return Profile(
        g.fingerprint,
        {d: DeviceInfo("cpu") for d in devices},
        {d: {o.id: OpCost(s) for o in g.ops} for d, s in seconds.items()} | ({store: {}} if store else {}),
        {f"{x}->{y}": link for x in devices for y in devices if x != y},
    )


def sweep_three_devices(
    plan_of: Callable[[Problem], Plan],
    examples: int,
    store: str | None = None,
    no_plan: tuple[type[Exception], ...] = (BudgetError,),
    also: Callable[[Graph, Plan, dict[str, str]], None] | None = None,
) -> None:
    """Random training graphs on a, b, c (and `store`), random homes among them, budgets on one or two of a, b, c:
    each plan of `plan_of` valid (simulator, independent counts, event sweep; then `also`) or one of `no_plan`
    raised; at least a fifth of the draws give a plan (a sweep that never planned would pass vacuously)."""
    devices = (*DEVICES, *([store] if store else []))
    found: list[bool] = []

    @settings(max_examples=examples, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(train_dags(max_ops=6), st.data())
    def draw(g: Graph, data) -> None:
        b_s, bandwidth = data.draw(st.sampled_from([0.5, 1.0])), data.draw(st.sampled_from([1.0, 100.0]))
        profile = three_devices(g, b_s, bandwidth, store)
        homes = {v: data.draw(st.sampled_from(devices)) for v in g.inputs}
        limited = data.draw(st.lists(st.sampled_from(DEVICES), min_size=1, max_size=2, unique=True))
        budgets = {d: data.draw(st.integers(0, 2 * eager_peak(g) + 50)) for d in limited}
        try:
            plan = plan_of(Problem(g, profile, budgets, list(devices), homes))
        except no_plan:
            found.append(False)
            return
        simulate(g, plan, profile)
        assert_prediction_matches(g, plan, profile, budgets)
        assert plan.predicted.makespan_s == pytest.approx(oracle_makespan(g, plan, profile))
        if also is not None:
            also(g, plan, homes)
        found.append(True)

    draw()
    assert sum(found) >= 0.2 * len(found), f"{sum(found)} plans in {len(found)} draws"


def grad_homed_on_c() -> tuple[Graph, Profile, dict[str, str]]:
    """Five ops; p0 homed on c, so g_p0 must end there; in0 and p1 on a, in1 on b (found by a random sweep)."""
    values = (
        *(Value(f"in{i}", 0, "input") for i in range(2)),
        Value("p0", 13, "param"),
        Value("p1", 24, "param"),
        *(Value(v, n) for v, n in (("v0_0", 0), ("v0_1", 37), ("v1_0", 1), ("v1_1", 45), ("v2_0", 27))),
        Value("g_p0", 13, grad_of="p0"),
        Value("g_p1", 24, grad_of="p1"),
    )
    ops = (
        Op("o0", "t", (), ("v0_0", "v0_1")),
        Op("o1", "t", (), ("v1_0", "v1_1"), phase="bwd"),
        Op("o2", "t", ("in0", "v1_1", "v0_1"), ("v2_0",), phase="bwd"),
        Op("grad_p0", "t", ("in0", "in1"), ("g_p0",), phase="bwd"),
        Op("grad_p1", "t", ("v1_0",), ("g_p1",), phase="bwd"),
    )
    g = Graph("rand", values, ops, ("g_p0", "g_p1"))
    return g, three_devices(g), {"in0": "a", "in1": "b", "p0": "c", "p1": "a"}


def test_a_gradient_homed_on_a_third_device_reaches_it() -> None:
    """The repro: park's plan is valid (simulator and independent counts) within a's budget, and g_p0 ends on c."""
    g, profile, homes = grad_homed_on_c()
    budgets = {"a": 156}
    plan = park_remat(Problem(g, profile, budgets, list(DEVICES), homes))
    simulate(g, plan, profile)  # raises on a read of a value not resident, or a budget exceeded
    assert_prediction_matches(g, plan, profile, budgets)
    assert plan.predicted.makespan_s == pytest.approx(oracle_makespan(g, plan, profile))
    assert ("g_p0", "c") in resident_at_end(g, plan)


def test_a_gradient_parked_for_good_goes_home_from_the_store() -> None:
    """The repro's variants on a with b as the store, in every starting order: each plan that fits is valid, and
    one parks g_p0 on b for good (a to b, then b to c: the rule the bug broke). The budget is the repro's 156 B less
    p0's 13 B, which the timeline no longer counts on a (homed on c, never read there): the same squeeze."""
    g, profile, homes = grad_homed_on_c()
    budgets = {"a": 143}
    routes: list[list[tuple[str, str]]] = []
    for name, order in starting_orders(g).items():
        try:
            plan = park_variant(g, profile, budgets, homes, "a", "b", name, order, 0, 0.0, 1.0, 0.0)
        except BudgetError:
            continue
        simulate(g, plan, profile)
        assert_prediction_matches(g, plan, profile, budgets)
        assert ("g_p0", "c") in resident_at_end(g, plan)
        routes.append([(s.src, s.dst) for s in plan.steps if isinstance(s, Copy) and s.value == "g_p0"])
    assert [("a", "b"), ("b", "c")] in routes, routes


def gradient_behind_another_park(direct_link: bool, o2_reads_p0: bool = False) -> tuple[Graph, Profile]:
    """Four ops on a, 1 s each: o0 makes w (20 B, an output that may end anywhere), grad_p0 g_p0 (20 B; p0 homed on
    c), o2 y (30 B; reading p0 if `o2_reads_p0`), o3 z (0 B). Every link 0.1 s + 10 B/s (a 20 B copy takes 2.1 s),
    a->c only if `direct_link`."""
    values = (Value("p0", 20, "param"), Value("w", 20), Value("g_p0", 20, grad_of="p0"), Value("y", 30), Value("z", 0))
    ops = (
        Op("o0", "t", (), ("w",)),
        Op("grad_p0", "t", (), ("g_p0",), phase="bwd"),
        Op("o2", "t", ("p0",) if o2_reads_p0 else (), ("y",), phase="bwd"),
        Op("o3", "t", (), ("z",), phase="bwd"),
    )
    g = Graph("hand", values, ops, ("w", "y", "z", "g_p0"))
    link = LinkCost(0.1, 10.0)
    pairs = [(x, y) for x in DEVICES for y in DEVICES if x != y and (direct_link or (x, y) != ("a", "c"))]
    return g, Profile(
        g.fingerprint,
        {d: DeviceInfo("cpu") for d in DEVICES},
        {d: {o.id: OpCost(1.0) for o in g.ops} for d in DEVICES},
        {f"{x}->{y}": link for x, y in pairs},
    )


@pytest.mark.parametrize("direct_link", [True, False])
def test_a_gradient_goes_straight_home_where_that_frees_the_device_sooner(direct_link: bool) -> None:
    """a at 40 B (by position: 20, 40, 70, 70 B; p0, homed on c and never read, is not there) must free w and g_p0
    before o2; b is the store. By hand, with the a->c link: w's copy to b runs 1-3.1 s, g_p0's straight to c beside it 2-4.1, o2
    waits for both frees (4.1-5.1), o3 5.1-6.1: 6.1 s. Through the store (no a->c link, or park before this
    option), g_p0's copy to b queues behind w's (3.1-5.2), o2 5.2-6.2, o3 6.2-7.2, and its copy b->c 5.2-7.3: 7.3 s."""
    g, profile = gradient_behind_another_park(direct_link)
    budgets = {"a": 40}
    plan = park_variant(g, profile, budgets, {"p0": "c"}, "a", "b", "graph", (0, 1, 2, 3), 0, 0.0, 1.0, 0.0)
    simulate(g, plan, profile)
    assert_prediction_matches(g, plan, profile, budgets)
    route = [(s.src, s.dst) for s in plan.steps if isinstance(s, Copy) and s.value == "g_p0"]
    assert route == ([("a", "c")] if direct_link else [("a", "b"), ("b", "c")])
    assert ("g_p0", "c") in resident_at_end(g, plan)
    assert oracle_makespan(g, plan, profile) == pytest.approx(6.1 if direct_link else 7.3)
    assert plan.predicted.makespan_s == pytest.approx(oracle_makespan(g, plan, profile))


@pytest.mark.parametrize(
    ("home", "reads", "counts"),
    [("c", False, [20, 40, 70, 70]), ("b", False, [20, 40, 70, 70]), ("c", True, [20, 40, 90, 70])],
)
def test_an_input_homed_elsewhere_is_counted_from_its_first_read(home: str, reads: bool, counts: list[int]) -> None:
    """Park's timeline on a (store b) by position, counted by hand: p0 (20 B) homed on c or b and never read takes
    no room; read by o2 from c, it is there at o2 alone (routing copies it in right before, frees it after). A plan
    20 B under the timeline's peak is valid by the simulator and the independent counts."""
    g, profile = gradient_behind_another_park(True, o2_reads_p0=reads)
    link = profile.link("a", "b")
    line = ParkTimeline(g, (0, 1, 2, 3), "a", profile, "b", link, link, {"p0": home})
    assert line.mem.tolist() == counts
    assert line.spans["p0"] == ([[2, 2]] if reads else [])
    budgets = {"a": max(counts) - 20}
    plan = park_variant(g, profile, budgets, {"p0": home}, "a", "b", "graph", (0, 1, 2, 3), 0, 0.0, 1.0, 0.0)
    simulate(g, plan, profile)
    assert_prediction_matches(g, plan, profile, budgets)


def test_an_input_homed_elsewhere_and_never_read_takes_no_room() -> None:
    """The case above at 60 B: p0 (20 B, homed on c) is never read on a, so a holds 20, 40, 70, 70 B by position and
    one park lowers o2's 70 B (main's timeline counted p0 from the start, 90 B, and parked both). By hand: w's copy
    to b runs 1-3.1 s (cheaper than g_p0's straight home, made a second later), o2 waits for its free (3.1-4.1),
    o3 4.1-5.1; g_p0 goes home a->c at the end, its copy 2-4.1 s beside the computes: 5.1 s, a's peak g_p0 + y at
    o2 (50 B)."""
    g, profile = gradient_behind_another_park(True)
    budgets = {"a": 60}
    plan = park_variant(g, profile, budgets, {"p0": "c"}, "a", "b", "graph", (0, 1, 2, 3), 0, 0.0, 1.0, 0.0)
    simulate(g, plan, profile)
    assert_prediction_matches(g, plan, profile, budgets)
    copies = [(s.value, s.src, s.dst) for s in plan.steps if isinstance(s, Copy)]
    assert copies == [("w", "a", "b"), ("g_p0", "a", "c")]
    assert {("w", "b"), ("g_p0", "c")} <= resident_at_end(g, plan)
    assert oracle_makespan(g, plan, profile) == pytest.approx(5.1)
    assert oracle_peaks(g, plan, profile)["a"] == 50


def test_auto_returns_a_valid_plan_for_three_computing_devices() -> None:
    """method="auto" on the repro: a plan within the budget by the independent counts (park no longer sinks it)."""
    g, profile, homes = grad_homed_on_c()
    budgets = {"a": 156}
    plan = solve(g, profile, budgets, list(DEVICES), homes=homes, options=SolverOptions(time_limit_s=5))
    simulate(g, plan, profile)
    assert_prediction_matches(g, plan, profile, budgets)


def test_every_three_device_park_plan_is_valid_or_none_is_found() -> None:
    """Random training graphs on three computing devices, random homes, budgets on one or two of them: each plan
    valid (simulator, independent counts, event sweep) or a BudgetError; at least a fifth of the draws give a plan."""
    sweep_three_devices(park_remat, 40)
