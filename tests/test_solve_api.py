"""solve(): every method returns a simulator-valid plan with predictions; budgets, defaults, errors and the MILP fallback."""

from __future__ import annotations

import sys
import types

import pytest
from conftest import chain_graph
from test_heuristics import DEVICES, two_device_profile

from xsched.contracts.plan import Compute
from xsched.errors import BudgetError, PlanError, XschedError
from xsched.simulate import simulate
from xsched.solve.api import solve
from xsched.solve.eager import eager_peak
from xsched.solve.heuristics import HEURISTICS

G = chain_graph([40, 60, 30, 50, 20] * 3, train=True)


@pytest.mark.parametrize("method", [m for m in HEURISTICS])
def test_each_heuristic_method_returns_a_valid_plan_with_predictions(method):
    profile = two_device_profile(G, slow_b=0.5)
    plan = solve(G, profile, {"a": "100%", "b": "100%"}, method=method)
    r = simulate(G, plan, profile)  # budgets checked
    assert plan.budgets == {"a": eager_peak(G), "b": eager_peak(G)}
    assert plan.predicted.time_s == pytest.approx(r.time_s) and dict(plan.predicted.peak_bytes) == dict(r.peak_bytes)
    assert plan.homes == {"x": "a"}  # default: every graph input on the first device
    assert plan.solver.method == f"heuristic:{method}"


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
    with pytest.raises(XschedError, match="unknown method 'magic'; choose one of auto, eager"):
        solve(G, profile, {"a": "1GiB"}, method="magic")
    with pytest.raises(BudgetError, match="not among the devices") as e:
        solve(G, profile, {"gpu": "1GiB"}, devices=["a"], method="eager")
    assert e.value.device == "gpu"
    with pytest.raises(PlanError, match="not a graph input") as e:
        solve(G, profile, {"a": "1GiB"}, method="eager", homes={"a3": "a"})
    assert e.value.value == "a3"


def fake_milp(monkeypatch, solve_milp) -> types.ModuleType:
    """Stand-in for xsched.solve.milp so the api's MILP path can be driven without a solver run."""

    class NoIncumbent(XschedError):
        def __init__(self, message: str) -> None:
            super().__init__(message, stage="solve")

    mod = types.ModuleType("xsched.solve.milp")
    mod.NoIncumbent = NoIncumbent
    mod.solve_milp = lambda *a, **k: solve_milp(mod, *a, **k)
    monkeypatch.setitem(sys.modules, "xsched.solve.milp", mod)
    return mod


def test_milp_without_incumbent_falls_back_to_the_best_heuristic(monkeypatch):
    seen = {}

    def no_incumbent(mod, graph, profile, budgets, devices, homes, options, warm_start=None):
        seen["warm"] = warm_start
        raise mod.NoIncumbent("highs stopped (time limit) after 1.0 s without a plan")

    fake_milp(monkeypatch, no_incumbent)
    profile = two_device_profile(G)
    plan = solve(G, profile, {"a": "70%"}, devices=["a"], method="milp")
    simulate(G, plan, profile)
    assert plan.solver.status == "heuristic" and plan.solver.method.startswith("heuristic:")
    assert plan.solver.extra["fallback_from"] == "milp" and "without a plan" in plan.solver.extra["reason"]
    assert seen["warm"] is not None and seen["warm"].steps == plan.steps  # the warm start is what comes back
    assert plan.budgets == {"a": int(eager_peak(G) * 0.7)}


def test_milp_gets_checked_budgets_first(monkeypatch):
    fake_milp(monkeypatch, lambda *a, **k: pytest.fail("the MILP must not run when the bound already fails"))
    with pytest.raises(BudgetError, match="below the lower bound") as e:
        solve(G, two_device_profile(G), {"a": 100}, devices=["a"], method="milp")
    assert e.value.device == "a" and e.value.op is not None


def test_milp_plan_is_validated_and_labelled():
    pytest.importorskip("xsched.solve.milp")
    from xsched.solve.options import SolverOptions

    g = chain_graph([40, 60, 30, 50, 20], train=True)  # 10 ops: a few seconds of HiGHS
    profile = two_device_profile(g, slow_b=0.5)
    plan = solve(g, profile, {"a": "80%", "b": "60%"}, method="milp", options=SolverOptions(time_limit_s=15))
    r = simulate(g, plan, profile)
    assert plan.solver.method == "milp" and plan.solver.status in ("optimal", "feasible", "time_limit")
    assert plan.predicted.time_s == pytest.approx(r.time_s)
    assert plan.solver.extra["warm_start"] is not None
    assert plan.predicted.time_s <= plan.solver.extra["warm_start_time_s"] + 1e-9  # no worse than its warm start


def test_a_given_warm_start_competes_with_the_heuristics(monkeypatch):
    import xsched.solve.api as api

    seen = []

    def echo(mod, *a, warm_start=None, **k):
        seen.append(warm_start)
        if warm_start is None:
            raise mod.NoIncumbent("stopped without a plan")
        return warm_start

    fake_milp(monkeypatch, echo)
    monkeypatch.setattr(api, "best_heuristic", lambda *a: (None, {}))
    profile = two_device_profile(G)
    given = solve(G, profile, {"a": "70%"}, devices=["a"], method="checkpoint")
    plan = solve(G, profile, {"a": "70%"}, devices=["a"], method="milp", warm_start=given)
    assert seen[-1].steps == given.steps and plan.steps == given.steps
    assert plan.solver.extra["warm_start"] == "heuristic:checkpoint"
    elsewhere = solve(G, profile, {"a": "100%", "b": "100%"}, method="eager", homes={"x": "b"})
    with pytest.raises(XschedError, match="no heuristic meets the budgets either.*other homes"):  # nothing is left
        solve(G, profile, {"a": "70%"}, devices=["a", "b"], method="milp", warm_start=elsewhere)


def test_milp_plan_slower_than_its_warm_start_gives_the_warm_start_back(monkeypatch):
    from dataclasses import replace

    from xsched.contracts.plan import SolverInfo
    from xsched.solve.remat import checkpoint_plan

    profile = two_device_profile(G)
    slow = checkpoint_plan(G, set(), "a", profile, homes={"x": "a"})  # recomputes every forward value
    fake_milp(monkeypatch, lambda mod, *a, **k: replace(slow, solver=SolverInfo("milp", "time_limit", 0.5, 1.0)))
    plan = solve(G, profile, {"a": slow.predicted.peak_bytes["a"]}, devices=["a"], method="milp")
    simulate(G, plan, profile)
    assert plan.predicted.time_s < slow.predicted.time_s
    assert plan.solver.status == "heuristic" and plan.solver.extra["fallback_from"] == "milp"
    assert "its warm start" in plan.solver.extra["reason"]


def test_the_heuristics_time_counts_in_an_exact_methods_limit(monkeypatch):
    """The warm start's heuristics run inside the caller's time limit: the exact method gets what is left (at
    least MIN_EXACT_S), so `method="hier"` on a large graph does not overrun its limit by the heuristics' seconds."""
    import time

    import xsched.solve.api as api
    from xsched.solve.options import SolverOptions

    limits = []

    def echo(mod, *a, warm_start=None, **k):
        limits.append(a[5].time_limit_s)
        return warm_start

    def slow_heuristics(*a):
        time.sleep(0.3)
        return solve(G, two_device_profile(G), {"a": "70%"}, devices=["a"], method="checkpoint"), {}

    fake_milp(monkeypatch, echo)
    monkeypatch.setattr(api, "best_heuristic", slow_heuristics)
    profile = two_device_profile(G)
    solve(G, profile, {"a": "70%"}, devices=["a"], method="milp", options=SolverOptions(time_limit_s=10.0))
    solve(G, profile, {"a": "70%"}, devices=["a"], method="milp", options=SolverOptions(time_limit_s=0.2))
    assert 9.0 < limits[0] <= 9.7 and limits[1] == api.MIN_EXACT_S
