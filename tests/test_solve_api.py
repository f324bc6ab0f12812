"""solve(): every method returns a simulator-valid plan with predictions; budgets, defaults, errors and the MILP fallback."""

from __future__ import annotations

from dataclasses import replace

import pytest
from conftest import chain_graph
from oracle import assert_prediction_matches
from test_heuristics import DEVICES, two_device_profile

from xsched.contracts.plan import Compute, Copy
from xsched.contracts.profile import DeviceInfo, LinkCost, OpCost, Profile
from xsched.contracts.result import SolveResult
from xsched.errors import BudgetError, NoIncumbent, PlanError, XschedError
from xsched.simulate import simulate
from xsched.solve.api import solve
from xsched.solve.objective import objective
from xsched.solve.options import SolverOptions, using_clock
from xsched.solve.problem import Outcome
from xsched.solve.reference import eager_peak
from xsched.solve.registry import SOLVERS, SolverEntry

G = chain_graph([40, 60, 30, 50, 20] * 3, train=True)
HEURISTICS = [n for n, e in SOLVERS.items() if e.kind == "heuristic"]


@pytest.mark.parametrize("method", [m for m in HEURISTICS])
def test_each_heuristic_method_returns_a_valid_plan_with_predictions(method):
    profile = two_device_profile(G, slow_b=0.5)
    plan = solve(G, profile, {"a": "100%", "b": "100%"}, method=method)
    assert plan.budgets == {"a": eager_peak(G), "b": eager_peak(G)}
    assert_prediction_matches(G, plan, profile)  # an independent count of its time and peaks, within the budgets
    assert plan.homes == {"x": "a"}  # default: every graph input on the first device
    assert plan.solver.method == method and plan.solver.status == "heuristic"


def test_percent_budgets_are_relative_to_the_eager_peak():
    profile = two_device_profile(G)
    plan = solve(G, profile, {"a": "50%"}, method="checkpoint")
    assert plan.budgets == {"a": eager_peak(G) // 2}
    assert simulate(G, plan, profile).peak_bytes["a"] <= eager_peak(G) // 2
    assert all(s.device == "a" for s in plan.steps if isinstance(s, Compute))


def test_devices_default_to_the_profile_and_unknown_method_errors():
    profile = two_device_profile(G)
    plan = solve(G, profile, {}, method="eager")
    assert set(plan.devices) <= set(DEVICES) and plan.budgets == {}
    with pytest.raises(XschedError, match="unknown method 'magic'; choose one of auto, portfolio, heuristics, eager"):
        solve(G, profile, {"a": "1GiB"}, method="magic")
    with pytest.raises(BudgetError, match="not among the devices") as e:
        solve(G, profile, {"gpu": "1GiB"}, devices=["a"], method="eager")
    assert e.value.device == "gpu"
    with pytest.raises(PlanError, match="not a graph input") as e:
        solve(G, profile, {"a": "1GiB"}, method="eager", homes={"a3": "a"})
    assert e.value.value == "a3"


def fake_milp(monkeypatch, run) -> list:
    """Register a stand-in "milp" (run(problem, options, warm) -> SolveResult) so the runner's single-method path can
    be driven without a solver run; returns the list of (time limit, warm start) it was called with."""
    calls: list = []

    def fn(problem, options, warm):
        calls.append((options.time_limit_s, warm))
        return run(problem, options, warm)

    monkeypatch.setitem(SOLVERS, "milp", SolverEntry("milp", fn, max_size=300))
    return calls


def stopped(problem, options, warm) -> Outcome:
    err = NoIncumbent("highs stopped (time limit) after 1.0 s without a plan")
    return Outcome(SolveResult("milp", "no_incumbent", message=err.detail, error=err))


def test_milp_without_incumbent_falls_back_to_the_best_heuristic(monkeypatch):
    calls = fake_milp(monkeypatch, stopped)
    profile = two_device_profile(G)
    plan = solve(G, profile, {"a": "70%"}, devices=["a"], method="milp")
    assert_prediction_matches(G, plan, profile)
    assert plan.solver.method == "milp" and plan.solver.status == "heuristic"
    assert plan.solver.found_by in HEURISTICS and "without a plan" in plan.solver.stats.fallback_reason
    assert calls[0][1] is not None and calls[0][1].steps == plan.steps  # the warm start is what comes back
    assert plan.budgets == {"a": int(eager_peak(G) * 0.7)}


def test_milp_gets_checked_budgets_first(monkeypatch):
    fake_milp(monkeypatch, lambda *a: pytest.fail("the MILP must not run when the bound already fails"))
    with pytest.raises(BudgetError, match="below the lower bound") as e:
        solve(G, two_device_profile(G), {"a": 100}, devices=["a"], method="milp")
    assert e.value.device == "a" and e.value.op is not None


def test_milp_plan_is_validated_and_labelled():
    g = chain_graph([40, 60, 30, 50, 20], train=True)  # 10 ops: a few seconds of HiGHS
    profile = two_device_profile(g, slow_b=0.5)
    budgets = {"a": int(0.8 * eager_peak(g)), "b": int(0.6 * eager_peak(g))}
    plan = solve(g, profile, budgets, method="milp", options=SolverOptions(time_limit_s=15, solver_threads=1))
    assert_prediction_matches(g, plan, profile, budgets)
    assert plan.solver.method == "milp" and plan.solver.status in ("optimal", "feasible", "time_limit")
    assert plan.solver.stats.warm_start is not None
    warm = solve(g, profile, budgets, ["a", "b"], "heuristics", homes={"x": "a"})
    assert objective(plan) <= objective(warm) * (1 + 1e-9)  # no worse than its warm start


def test_a_given_warm_start_competes_with_the_heuristics(monkeypatch, registry):
    def echo(problem, options, warm):
        if warm is None:
            return stopped(problem, options, warm)
        return Outcome(replace(warm.solver, method="milp", status="feasible"), warm)

    calls = fake_milp(monkeypatch, echo)
    profile = two_device_profile(G)
    given = solve(G, profile, {"a": "70%"}, devices=["a"], method="checkpoint")
    elsewhere = solve(G, profile, {"a": "100%", "b": "100%"}, method="eager", homes={"x": "b"})
    for name in HEURISTICS:  # no heuristic: the caller's plan is the only start
        del registry[name]
    plan = solve(G, profile, {"a": "70%"}, devices=["a"], method="milp", warm_start=given)
    assert calls[-1][1].steps == given.steps and plan.steps == given.steps
    with pytest.raises(XschedError, match="no heuristic meets the budgets either.*other homes"):  # nothing is left
        solve(G, profile, {"a": "70%"}, devices=["a", "b"], method="milp", warm_start=elsewhere)


def test_milp_plan_slower_than_its_warm_start_gives_the_warm_start_back(monkeypatch):
    from xsched.solve.heuristics.checkpoint import checkpoint_plan

    profile = two_device_profile(G)
    slow = checkpoint_plan(G, set(), "a", profile, homes={"x": "a"})  # recomputes every forward value
    record = SolveResult("milp", "time_limit", gap=0.5)
    fake_milp(monkeypatch, lambda *a: Outcome(record, slow))
    plan = solve(G, profile, {"a": slow.predicted.peak_bytes["a"]}, devices=["a"], method="milp")
    assert_prediction_matches(G, plan, profile)
    assert plan.predicted.time_s < slow.predicted.time_s
    assert plan.solver.method == "milp" and plan.solver.status == "heuristic"
    assert "its warm start" in plan.solver.stats.fallback_reason


class Clock:
    """A stand-in for time.perf_counter: the heuristics advance it by what they are said to take."""

    def __init__(self) -> None:
        self.now = 100.0

    def perf_counter(self) -> float:
        return self.now


def test_the_heuristics_time_counts_in_an_exact_methods_limit(monkeypatch):
    """The warm start's heuristics run inside the caller's time limit: the exact method gets what is left (at
    least MIN_METHOD_S), so `method="hier"` on a large graph does not overrun its limit by the heuristics' seconds."""
    import xsched.solve.runner as runner

    clock = Clock()
    for name in HEURISTICS:
        fn = SOLVERS[name].fn

        def slow(problem, options, warm, fn=fn):
            clock.now += 0.3
            return fn(problem, options, warm)

        monkeypatch.setitem(SOLVERS, name, replace(SOLVERS[name], fn=slow))
    calls = fake_milp(monkeypatch, stopped)
    profile = two_device_profile(G)
    with using_clock(clock.perf_counter):
        solve(G, profile, {"a": "70%"}, devices=["a"], method="milp", options=SolverOptions(time_limit_s=10.0))
        solve(G, profile, {"a": "70%"}, devices=["a"], method="milp", options=SolverOptions(time_limit_s=0.2))
    spent = 0.3 * len(HEURISTICS)
    assert calls[0][0] == pytest.approx(10.0 - spent) and calls[1][0] == runner.MIN_METHOD_S


# ---- one ranking rule: time + alpha x energy, in every method
SMALL = chain_graph([40, 60, 30, 50, 20], train=True)
ALPHA = 1.0  # seconds a joule is worth: b's 2 s + 1 J beat a's 1 s + 10 J an op
ONE_DEVICE_CHOOSERS = ("eager", "sqrt", "checkpoint", "gaps")  # they rank one plan per device


def energy_profile(g) -> Profile:
    """a runs an op in 1 s for 10 J, b in 2 s for 1 J; links 0.1 s + 1 B/s both ways, 0.01 J a byte."""
    compute = {"a": {o.id: OpCost(1.0, 10.0) for o in g.ops}, "b": {o.id: OpCost(2.0, 1.0) for o in g.ops}}
    link = LinkCost(0.1, 1.0, energy_j_per_byte=0.01)
    return Profile(g.fingerprint, {d: DeviceInfo("cpu") for d in DEVICES}, compute, {"a->b": link, "b->a": link})


def energy_of(g, plan, profile: Profile) -> float:
    """Joules counted step by step from the profile (not the plan's prediction)."""
    ops = sum(profile.op_cost(s.op, s.device).energy_j for s in plan.steps if isinstance(s, Compute))
    nbytes = {v.id: v.nbytes for v in g.values}
    moved = sum(
        nbytes[s.value] * profile.link(s.src, s.dst).energy_j_per_byte for s in plan.steps if isinstance(s, Copy)
    )
    return ops + moved


@pytest.mark.parametrize("method", [m for m in SOLVERS if SOLVERS[m].available()])
def test_every_method_ranks_by_time_plus_alpha_energy(method):
    profile = energy_profile(SMALL)
    budgets = {"a": "100%", "b": "100%"}
    weighted = SolverOptions(time_limit_s=2, solver_threads=1, alpha_energy=ALPHA, hier_processes=1)
    plan = solve(SMALL, profile, budgets, method=method, options=weighted)
    assert_prediction_matches(SMALL, plan, profile)
    assert plan.solver.objective == pytest.approx(plan.predicted.makespan_s + ALPHA * energy_of(SMALL, plan, profile))
    if SOLVERS[method].kind != "heuristic":  # never worse, by the weighted objective, than the heuristics' best
        best = solve(SMALL, profile, budgets, method="heuristics", options=weighted)
        assert objective(plan, ALPHA) <= objective(best, ALPHA) * (1 + 1e-9)
        return
    fast = solve(SMALL, profile, budgets, method=method, options=replace(weighted, alpha_energy=0.0))
    assert objective(plan, ALPHA) <= objective(fast, ALPHA) * (1 + 1e-9)
    if method in ONE_DEVICE_CHOOSERS:  # the fast device unweighted, the frugal one weighted
        assert {s.device for s in fast.steps if isinstance(s, Compute)} == {"a"}
        assert {s.device for s in plan.steps if isinstance(s, Compute)} == {"b"}


@pytest.mark.parametrize("name", ["milp_1b855da", "portfolio_1b855da"])
def test_a_plan_file_of_the_previous_version_still_loads(name):
    """tests/plans/*_1b855da.json: plans saved at commit 1b855da (before solvers returned an Outcome), by
    `solve(chain_graph([40, 60, 30, 50, 20], train=True), two_device_profile(g, slow_b=0.5), ...)` with method milp
    (70%) and portfolio (80%). They load, their records with them, and replay as they were saved."""
    from pathlib import Path

    from xsched.contracts.plan import Plan
    from xsched.contracts.result import HeuristicStats, MilpStats, RunStats

    g = chain_graph([40, 60, 30, 50, 20], train=True)
    plan = Plan.load(Path(__file__).parent / "plans" / f"{name}.json")
    assert plan.graph == g.fingerprint and plan.solver.method == name.split("_")[0]
    if name.startswith("milp"):
        assert isinstance(plan.solver.stats, MilpStats) and plan.solver.stats.incumbents > 0
    else:
        stats = plan.solver.stats
        assert isinstance(stats, RunStats) and stats.found.method == stats.found_by
        assert isinstance(stats.found.stats, HeuristicStats) and stats.members
    assert_prediction_matches(g, plan, two_device_profile(g, slow_b=0.5))
    assert Plan.from_dict(plan.to_dict()) == plan  # and write back the same
