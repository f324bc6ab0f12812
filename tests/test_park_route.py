"""An output whose home has no copy link from the device that makes it. Routing sends it through a relay (park's
store, another of the problem's devices) where a chain of links exists; a plan that cannot get it there fails
with a BudgetError saying not found, so `auto` goes on to its other members; and where no plan at all can get it
there over the profile's links, check_budgets says so, proven. Main raised a PlanError in every case, ending
`auto`. Plans are checked by the simulator and against independent counts and an event sweep (tests/oracle.py)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from oracle import assert_prediction_matches, resident_at_end
from oracle import makespan as oracle_makespan
from test_heuristics import train_dags
from test_park_three import DEVICES, gradient_behind_another_park, three_devices

from xsched.contracts.graph import Graph
from xsched.contracts.plan import Compute, Copy, Plan
from xsched.contracts.profile import DeviceInfo, LinkCost, OpCost, Profile
from xsched.errors import BudgetError, NoLinkError
from xsched.simulate import simulate
from xsched.solve import SolverOptions, runner, solve
from xsched.solve.bounds.memory import check_budgets
from xsched.solve.bounds.reach import check_reach
from xsched.solve.heuristics.eager import eager
from xsched.solve.heuristics.park import park_remat, park_variant
from xsched.solve.heuristics.routing import route
from xsched.solve.problem import Problem
from xsched.solve.reference import eager_peak
from xsched.solve.registry import SOLVERS, run_member

pytestmark = pytest.mark.usefixtures("one_thread")
HOMES = {"p0": "c"}  # g_p0 must end on c


def no_link_to_c(g: Graph, links: set[tuple[str, str]], computing: tuple[str, ...] = ("a",)) -> Profile:
    """`computing` run every op in 1 s (the rest run none); `links` (0.1 s + 10 B/s: a 20 B copy takes 2.1 s)."""
    link = LinkCost(0.1, 10.0)
    return Profile(
        g.fingerprint,
        {d: DeviceInfo("cpu") for d in DEVICES},
        {d: {o.id: OpCost(1.0) for o in g.ops} if d in computing else {} for d in DEVICES},
        {f"{x}->{y}": link for x, y in links},
    )


ALL = {(x, y) for x in DEVICES for y in DEVICES if x != y}
RELAY = ALL - {("a", "c")}  # a reaches c only through b
NO_WAY_IN = ALL - {("a", "c"), ("b", "c")}  # nothing reaches c


def check(g: Graph, plan: Plan, profile: Profile, budgets: dict[str, int]) -> list[tuple[str, str]]:
    """The plan valid (simulator, independent counts, event sweep), g_p0 on c at the end; g_p0's copies."""
    simulate(g, plan, profile)
    assert_prediction_matches(g, plan, profile, budgets)
    assert plan.predicted.makespan_s == pytest.approx(oracle_makespan(g, plan, profile))
    assert ("g_p0", "c") in resident_at_end(g, plan)
    return [(s.src, s.dst) for s in plan.steps if isinstance(s, Copy) and s.value == "g_p0"]


def test_park_sends_an_output_home_through_its_store() -> None:
    """Nothing parked (a at 1,000 B): g_p0 goes a -> b -> c. By hand: o0..o3 on a, 0-4 s; g_p0 is made at 2 s, its
    copy to b runs 2-4.1 s and on to c 4.1-6.2 s: 6.2 s."""
    g, _ = gradient_behind_another_park(False)
    profile = no_link_to_c(g, RELAY)
    budgets = {"a": 1000}
    plan = park_variant(g, profile, budgets, HOMES, "a", "b", "graph", (0, 1, 2, 3), 0, 0.0, 1.0, 0.0)
    assert check(g, plan, profile, budgets) == [("a", "b"), ("b", "c")]
    assert oracle_makespan(g, plan, profile) == pytest.approx(6.2)
    assert ("g_p0", "b") not in resident_at_end(g, plan)  # the relay's copy is freed once it has gone on


@pytest.mark.parametrize("budget", [1000, 40])
@pytest.mark.parametrize("method", ["park", "eager", "auto"])
def test_a_plan_is_found_where_a_relay_reaches_the_home(method: str, budget: int) -> None:
    """a the only computing device, no a -> c link: each method's plan valid with g_p0 through b. At 40 B eager
    does not fit (by hand, w and y at o2 are 50 B even with g_p0 sent home as it is made), park and auto do."""
    g, _ = gradient_behind_another_park(False)
    profile = no_link_to_c(g, RELAY)
    budgets = {"a": budget}
    if method == "eager" and budget == 40:
        with pytest.raises(BudgetError, match=r"eager plan peaks at 50 B on a \(budget 40 B\)"):
            solve(g, profile, budgets, list(DEVICES), method, homes=HOMES)
        return
    plan = solve(g, profile, budgets, list(DEVICES), method, SolverOptions(time_limit_s=5), homes=HOMES)
    assert ("b", "c") in check(g, plan, profile, budgets)


def test_a_device_that_cannot_send_an_output_home_is_not_found_and_another_plans() -> None:
    """a and c both compute, nothing links a to c (b, a store, has no link to c either): routing a's computes says
    not found, naming g_p0 and the devices; eager goes on to c, whose plan makes g_p0 there; auto plans too."""
    g, _ = gradient_behind_another_park(False)
    profile = no_link_to_c(g, NO_WAY_IN, computing=("a", "c"))
    with pytest.raises(BudgetError) as e:
        route(g, [Compute(o.id, "a") for o in g.ops], {"p0": "c"}, profile, via=DEVICES)
    assert (
        e.value.detail
        == "not found: no copy link brings g_p0 from a to c in the profile, nor a chain of links through b"
    )
    with pytest.raises(BudgetError):  # park's one pair, a and its store b: g_p0 can neither go on from b nor leave a
        park_remat(Problem.make(g, profile, {"a": 40}, list(DEVICES), HOMES))
    plan = eager(Problem.make(g, profile, {}, list(DEVICES), HOMES))
    assert {s.device for s in plan.steps if isinstance(s, Compute)} == {"c"}
    check(g, plan, profile, {})
    budgets = {"a": 40}
    check(
        g,
        solve(g, profile, budgets, list(DEVICES), homes=HOMES, options=SolverOptions(time_limit_s=5)),
        profile,
        budgets,
    )


def test_park_sends_an_output_straight_home_where_the_store_has_no_link_on() -> None:
    """a -> b takes 0.12 s for 20 B, a -> c 4.1 s, and b has no link to c: at 40 B, w and g_p0 must both be off a
    before o2, and g_p0 goes a -> c, though parking it on b would free a sooner (main did, then had no way on from
    b). By hand: o0 0-1 s, grad_p0 1-2, w to b 1-1.12, g_p0 to c 2-6.1, o2 waits for its free (6.1-7.1), o3 7.1-8.1."""
    g, _ = gradient_behind_another_park(False)
    fast, slow = LinkCost(0.1, 1000.0), LinkCost(0.1, 5.0)
    links = {"a->b": fast, "b->a": fast, "a->c": slow, "c->a": slow, "c->b": slow}
    costs = {"a": {o.id: OpCost(1.0) for o in g.ops}, "b": {}, "c": {}}
    profile = Profile(g.fingerprint, {d: DeviceInfo("cpu") for d in DEVICES}, costs, links)
    budgets = {"a": 40}
    plan = park_variant(g, profile, budgets, HOMES, "a", "b", "graph", (0, 1, 2, 3), 0, 0.0, 1.0, 0.0)
    assert check(g, plan, profile, budgets) == [("a", "c")]
    assert oracle_makespan(g, plan, profile) == pytest.approx(8.1)


@pytest.mark.parametrize("method", ["park", "auto"])
def test_an_output_no_link_can_bring_home_is_proven_infeasible(method: str) -> None:
    """Only a computes and no link enters c: no plan can end g_p0 there, whatever the budget (1,000 B)."""
    g, _ = gradient_behind_another_park(False)
    profile = no_link_to_c(g, NO_WAY_IN)
    with pytest.raises(BudgetError, match="g_p0 must end on c, but no copy link or chain of links") as e:
        solve(g, profile, {"a": 1000}, list(DEVICES), method, SolverOptions(time_limit_s=5), homes=HOMES)
    assert "\n" not in str(e.value)
    if method == "auto":
        assert "proven infeasible" in str(e.value)


def test_the_runner_gives_a_missing_link_its_proof_alone(monkeypatch) -> None:
    """No link enters c: the runner says the proof and nothing about budgets (no larger budget can add a link, so
    no probe for one that works is run and no largest failing budget is named); the error says which kind it is."""
    g, _ = gradient_behind_another_park(False)
    profile = no_link_to_c(g, NO_WAY_IN)
    probes: list[object] = []
    monkeypatch.setattr(runner, "_known_to_work", lambda *a: probes.append(a) or "none found")
    with pytest.raises(NoLinkError) as e:
        solve(g, profile, {"a": 1000}, list(DEVICES), "auto", SolverOptions(time_limit_s=5), homes=HOMES)
    assert str(e.value).startswith("[solve] no plan within the budgets: proven infeasible (g_p0 must end on c, but")
    assert "budget known" not in str(e.value) and "lower bound" not in str(e.value)
    assert (e.value.value, e.value.device) == ("g_p0", "c")
    assert probes == []
    # a budget below what the graph needs still gets its hint and its probe
    with pytest.raises(BudgetError, match="largest known not to: a .* [(]lower bound[)]") as low:
        solve(g, no_link_to_c(g, ALL), {"a": 1}, list(DEVICES), "auto", SolverOptions(time_limit_s=5), homes=HOMES)
    assert not isinstance(low.value, NoLinkError) and len(probes) == 1


def test_an_input_that_cannot_reach_the_op_reading_it_is_proven_infeasible() -> None:
    """p0 read by o2 (only a computes) and homed on c, with no link out of c: no plan can run o2."""
    g, _ = gradient_behind_another_park(False, o2_reads_p0=True)
    profile = no_link_to_c(g, ALL - {("c", "a"), ("c", "b")})
    with pytest.raises(BudgetError, match="op o2 runs only on a, and no copy link .* brings its input p0"):
        check_budgets(g, profile, {}, DEVICES, {"p0": "c"})
    check_budgets(g, no_link_to_c(g, ALL - {("c", "a")}), {}, DEVICES, {"p0": "c"})  # through b: possible


def links_dropped(g: Graph, data) -> tuple[Profile, dict[str, str], dict[str, int], bool]:
    """One draw of the links sweeps (here and test_hier_route): `three_devices`' profile with each link dropped at
    random and c running no op in some draws, random homes, a budget on a in some; and whether check_reach proves
    that no plan exists."""
    full = three_devices(g)
    kept = {x: full.copy[x] for x in sorted(full.copy) if data.draw(st.booleans())}
    compute = dict(full.compute) | ({} if data.draw(st.booleans()) else {"c": {}})
    profile = Profile(g.fingerprint, full.devices, compute, kept)
    homes = {v: data.draw(st.sampled_from(DEVICES)) for v in g.inputs}
    budgets = {"a": data.draw(st.integers(0, 2 * eager_peak(g)))} if data.draw(st.booleans()) else {}
    try:
        check_reach(g, profile, DEVICES, homes)
    except BudgetError:
        return profile, homes, budgets, True
    return profile, homes, budgets, False


def test_with_links_missing_every_heuristic_plan_is_valid_and_none_beats_a_proof() -> None:
    """Random training graphs on a, b, c (c running no op in some draws), each link dropped at random, random homes,
    a budget on a in some draws: check_reach's proof is never contradicted by a heuristic's plan (the simulator
    would accept it), every plan is valid (simulator, independent counts, event sweep), no heuristic raises
    anything but BudgetError (main's PlanError ended `auto`); some draws are proven, a fifth plan."""
    heuristics = [e for e in SOLVERS.values() if e.kind == "heuristic"]
    proven: list[bool] = []
    planned: list[bool] = []

    # derandomized: the same 30 draws every run, so the closing count (some proven, a fifth planned) is a fact about
    # this sweep; random draws had none proven in about 1 run in 60 (hypothesis seed 44)
    @settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
    @given(train_dags(max_ops=5), st.data())
    def draw(g: Graph, data) -> None:
        profile, homes, budgets, no_plan = links_dropped(g, data)
        problem = Problem(g, profile, budgets, DEVICES, homes)
        found = False
        for entry in heuristics:
            r = run_member(entry, problem, SolverOptions(), None)
            if r.plan is None:
                assert isinstance(r.error, BudgetError), (entry.name, r.error)
                continue
            assert not no_plan, f"{entry.name} planned what check_reach proved impossible"
            simulate(g, r.plan, profile)
            assert_prediction_matches(g, r.plan, profile, budgets)
            assert r.plan.predicted.makespan_s == pytest.approx(oracle_makespan(g, r.plan, profile))
            found = True
        proven.append(no_plan)
        planned.append(found)

    draw()
    assert any(proven) and sum(planned) >= 0.2 * len(planned), (sum(proven), sum(planned), len(planned))
