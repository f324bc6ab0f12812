"""The solver entry point: parse the problem, check the bounds, dispatch to the registry's method (or `auto`), and
return a simulator-checked plan."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import replace

from xsched.contracts.graph import Graph
from xsched.contracts.plan import Plan, SolverInfo
from xsched.contracts.profile import Profile
from xsched.errors import XschedError
from xsched.solve.auto import solve_auto
from xsched.solve.heuristics import best_heuristic
from xsched.solve.memory_bounds import check_budgets
from xsched.solve.options import SolverOptions
from xsched.solve.problem import Problem, SolveResult, objective, validated
from xsched.solve.registry import SOLVERS

METHODS = ("auto", *SOLVERS)  # those registered at import


def solve(
    graph: Graph,
    profile: Profile,
    budgets: Mapping[str, str | int],
    devices: Sequence[str] | None = None,
    method: str = "auto",
    options: SolverOptions | None = None,
    homes: Mapping[str, str] | None = None,
    warm_start: Plan | None = None,
) -> Plan:
    """A plan for `graph` on `devices` within `budgets` ("4GiB", "16GB", bytes, or "50%" of the eager peak).

    devices: default the budgets' keys, else the profile's devices. homes: where each graph input lives; every
    graph input not named there (by default all of them) lives on the first device.
    method: "auto" (default: the bounds, every heuristic, then the exact solvers within options.time_limit_s; see
    xsched.solve.auto), a heuristic ("eager", "greedy", "fastest", "sqrt", "checkpoint", "offload"), or an exact
    solver ("milp", "intervals-highs", "intervals-cpsat", "portfolio"): warm-started from the best heuristic that
    fits; if it finds no incumbent in its time limit, or only one slower than that heuristic plan, the heuristic
    plan is returned with status "heuristic" and extra["fallback_from"] == the method; with neither, NoIncumbent
    (or BudgetError for a proof) is raised. warm_start: a plan of the caller's (same graph and homes) that competes
    with the heuristics for the warm start when it meets these budgets.
    """
    if method != "auto" and method not in SOLVERS:  # the registry as it is now: solvers registered later count
        raise XschedError(f"unknown method {method!r}; choose one of auto, {', '.join(SOLVERS)}", stage="solve")
    problem = Problem.make(graph, profile, budgets, devices, homes)
    options = options or SolverOptions()
    if method == "auto":
        return solve_auto(problem, options, warm_start)
    check_budgets(*problem.args())
    entry = SOLVERS[method]
    if not entry.available():
        raise XschedError(f"method {method!r} needs {entry.requires}: pip install xsched[cpsat]", stage="solve")
    if entry.kind == "heuristic":
        return plan_of(problem, entry.fn(problem, options, None))
    return _exact(problem, method, options, warm_start)


MIN_EXACT_S = 1.0  # an exact method gets at least this much, even when the heuristics took the whole limit


def plan_of(problem: Problem, result: SolveResult) -> Plan:
    """The result's plan, checked by the simulator; a result without one raises the backend's own error."""
    if result.plan is None:
        err = result.extra.get("error")
        if isinstance(err, XschedError):
            raise err
        raise XschedError(f"{result.method}: {result.status}: {result.message}", stage="solve")
    return validated(problem.graph, result.plan, problem.profile, problem.budgets)


def _exact(problem: Problem, method: str, options: SolverOptions, given: Plan | None = None) -> Plan:
    """One exact method, warm-started from the best heuristic (or the caller's plan), falling back to that start."""
    from xsched.solve.milp import NoIncumbent

    t0 = time.perf_counter()
    graph, profile, budgets, _, homes = problem.args()
    warm, why_not = best_heuristic(*problem.args())
    if given is not None:
        try:
            if dict(given.homes) != dict(homes):
                raise XschedError("the given warm start has other homes", stage="solve")
            given = validated(graph, given, profile, budgets)
        except XschedError as e:
            why_not["given"] = e.detail
        else:
            if warm is None or given.predicted.time_s < warm.predicted.time_s:
                warm = given
    if (
        warm is not None
        and options.energy_cap_j is not None
        and (warm.predicted.energy_j or 0.0) > options.energy_cap_j
    ):
        why_not["warm"] = f"{warm.solver.method} exceeds the energy cap"
        warm = None
    context = {
        "warm_start": warm.solver.method if warm is not None else None,
        "warm_start_time_s": warm.predicted.time_s if warm is not None else None,
        "heuristics_s": time.perf_counter() - t0,
    }

    def fall_back(reason: str, extra: Mapping[str, object] | None = None) -> Plan:
        x = {**warm.solver.extra, **(extra or {}), **context, "fallback_from": method, "reason": reason}
        info = SolverInfo(warm.solver.method, "heuristic", None, time.perf_counter() - t0, x)
        return replace(warm, solver=info)

    if options.time_limit_s is not None:  # the heuristics' time counts in the caller's limit
        options = replace(options, time_limit_s=max(MIN_EXACT_S, options.time_limit_s - context["heuristics_s"]))
    result = SOLVERS[method].fn(problem, options, warm)
    if result.plan is None:
        if result.status == "no_incumbent" and warm is not None:
            return fall_back(result.message)
        if result.status == "no_incumbent":
            reasons = "; ".join(f"{k}: {v}" for k, v in why_not.items())
            raise NoIncumbent(f"{result.message}, and no heuristic meets the budgets either ({reasons})")
        return plan_of(problem, result)  # the proof's BudgetError
    plan = validated(graph, result.plan, profile, budgets)
    if warm is not None and objective(warm, options) < objective(plan, options) * (1 - 1e-9):
        # a solver that stops early (or drops the start) can return an incumbent worse than the start it was given
        return fall_back(
            f"the {method} plan ({plan.solver.status}, gap {plan.solver.gap}) takes {plan.predicted.time_s:.6g} s, "
            f"its warm start {warm.predicted.time_s:.6g} s",
            {**plan.solver.extra, f"{method}_status": plan.solver.status, f"{method}_gap": plan.solver.gap},
        )
    return replace(plan, solver=replace(plan.solver, extra={**plan.solver.extra, **context}))


__all__ = ["METHODS", "objective", "plan_of", "solve", "validated"]
