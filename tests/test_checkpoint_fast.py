"""The checkpoint search skips planning candidates whose resident floor (checkpoint's cheap lower bound on a
peak) is over the budget: the floor bounds simulated peaks, fewer plans are made, and the plan (or the error) is
the one planning every candidate gives."""

from __future__ import annotations

import pytest
from conftest import chain_graph

from xsched.contracts.profile import DeviceInfo, OpCost, Profile
from xsched.errors import BudgetError
from xsched.simulate import simulate
from xsched.solve.heuristics import checkpoint as CK
from xsched.solve.heuristics.routing import route
from xsched.solve.options import deadline
from xsched.solve.problem import Problem
from xsched.solve.reference import eager_peak

SIZES = [400, 100, 300, 200, 500, 100, 300, 200, 100]


def problem(percent: int, sizes: list[int] = SIZES) -> Problem:
    g = chain_graph(sizes, train=True)
    profile = Profile(
        g.fingerprint, {"d": DeviceInfo("cpu")}, {"d": {o.id: OpCost(1e-3 * (i % 3 + 1)) for i, o in enumerate(g.ops)}}
    )
    return Problem(g, profile, {"d": eager_peak(g) * percent // 100}, ("d",), {"x": "d"})


def counted_search(p: Problem, monkeypatch: pytest.MonkeyPatch, *, bounded: bool):
    """The search's plan (or BudgetError) and how many candidates it routed; unbounded: every floor is 0."""
    routed = []
    real_route = CK.route
    monkeypatch.setattr(CK, "route", lambda *a, **k: routed.append(1) or real_route(*a, **k))
    if not bounded:
        monkeypatch.setattr(CK, "resident_floor", lambda *a, **k: 0)
    try:
        result = CK.checkpoint_search(p)
    except BudgetError as e:
        result = e
    monkeypatch.undo()
    return result, len(routed)


def test_resident_floor_bounds_every_candidates_peak() -> None:
    p = problem(100)
    g, homes = p.graph, p.homes
    ends = CK.ends_on_one_device(g, homes)
    late = CK.lean.late_gradient_order(g, ends)
    remakes = [CK.lean.remake_window(g, w, homes, "d") for w in CK.lean.gradient_windows(g, ends)]
    cases = [CK.checkpoint_computes(g, k, "d") for k in CK.candidate_keeps(g)]
    cases += [CK.checkpoint_computes(g, k, "d", order=late, drop_recomputed=True) for k in CK.candidate_keeps(g)]
    cases += [cases[-1] + r for r in remakes]
    exact = 0
    for computes in cases:
        floor = CK.resident_floor(g, computes, "d", homes)
        plan = CK.finish(g, route(g, computes, homes, p.profile), "x", {}, homes, p.profile, 0.0)
        peak = simulate(g, plan, p.profile).peak_bytes
        assert 0 < floor <= peak["d"]
        exact += floor == peak["d"]
    assert exact >= len(cases) // 2  # a bound that is tight on most, not a token one
    # counting the graph outputs any window remakes as not kept, a base's floor bounds it with every window
    remade = {v for r in remakes for c in r for v in g.op[c.op].outputs}
    for base in cases[len(cases) // 2 : -len(remakes)]:
        floor = CK.resident_floor(g, base, "d", homes, remade)
        for r in remakes:
            plan = CK.finish(g, route(g, base + r, homes, p.profile), "x", {}, homes, p.profile, 0.0)
            assert floor <= simulate(g, plan, p.profile).peak_bytes["d"]


def test_no_fit_is_found_without_planning_the_candidates(monkeypatch: pytest.MonkeyPatch) -> None:
    p = problem(20)
    before, routed_before = counted_search(p, monkeypatch, bounded=False)
    after, routed_after = counted_search(p, monkeypatch, bounded=True)
    assert isinstance(before, BudgetError) and isinstance(after, BudgetError)
    assert str(after).split(";")[0] == str(before).split(";")[0]  # "none of N checkpoint candidates fits"
    assert routed_after < routed_before


def test_a_search_stopped_before_any_candidate_was_planned_says_so() -> None:
    """Past the deadline nothing after the first candidate (eviction, which cannot fit at 20%) is planned: the error
    says that none was planned before the time limit, not that the leanest of none peaks at 0 B."""
    with deadline(0):
        with pytest.raises(BudgetError) as e:
            CK.checkpoint_search(problem(20))
    assert "none of" in str(e.value) and "was planned before the time limit" in str(e.value)
    assert "0 B" not in str(e.value)


@pytest.mark.parametrize("percent", [40, 55, 70, 100])
def test_same_plan_as_planning_every_candidate(monkeypatch: pytest.MonkeyPatch, percent: int) -> None:
    p = problem(percent)
    before, _ = counted_search(p, monkeypatch, bounded=False)
    after, _ = counted_search(p, monkeypatch, bounded=True)
    if isinstance(before, BudgetError):
        assert isinstance(after, BudgetError)
    else:
        assert after.steps == before.steps


def lean_run(p: Problem, budget: float, bounded: bool) -> tuple[list[tuple[str, int]], int]:
    """lean_search on d, every candidate planned exactly: (label, peak) of those considered that fit the budget,
    in order, and how many were planned (bounded: with resident_floor, the budget and planning ahead)."""
    g, homes, planned, fits = p.graph, p.homes, {}, []

    def peak_of(computes: list) -> int:
        plan = CK.finish(g, route(g, computes, homes, p.profile), "x", {}, homes, p.profile, 0.0)
        return plan.predicted.peak_bytes["d"]

    def plan_ahead(computes: list) -> int:
        planned[id(computes)] = peak_of(computes)  # ids of lists the search holds until it considers them
        return planned[id(computes)]

    def consider(label: str, computes: list) -> int:
        peak = planned.pop(id(computes), None) or peak_of(computes)
        if peak <= budget:
            fits.append((label, peak))
        return peak

    count = [0]

    def counted(computes: list) -> int:
        count[0] += 1
        return plan_ahead(computes)

    keeps = CK.candidate_keeps(g)
    if bounded:
        floor = lambda c, remade: CK.resident_floor(g, c, "d", homes, remade)  # noqa: E731
        CK.lean_search(g, keeps, "d", homes, consider, floor=floor, budget=budget, plan_ahead=counted)
    else:
        CK.lean_search(g, keeps, "d", homes, lambda label, c: count.__setitem__(0, count[0] + 1) or consider(label, c))
    return fits, count[0]


def test_lean_search_considers_the_same_fits_and_plans_fewer() -> None:
    p = problem(100, SIZES * 4)  # enough keep sets for more lean bases than lean.WINDOW_BASES
    exhaustive, planned_all = lean_run(p, float("inf"), bounded=False)
    peaks = sorted({peak for _, peak in exhaustive})
    fitting = 0
    for budget in [peaks[0] - 1, peaks[0], peaks[len(peaks) // 4], peaks[len(peaks) // 2]]:
        before, n_before = lean_run(p, budget, bounded=False)
        after, n_after = lean_run(p, budget, bounded=True)
        assert after == before
        assert n_after <= n_before == planned_all
        fitting += bool(after)
    assert fitting >= 3  # budgets where some lean candidate fits, not only ones where none does
    assert lean_run(p, peaks[0] - 1, bounded=True)[1] < planned_all // 2  # none fits: most are never planned
