"""The solver entry point: parse budgets, check feasibility, run one method, return a simulator-checked plan."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from xsched.budgets import parse_budgets
from xsched.errors import BudgetError, PlanError, XschedError
from xsched.graph import Graph
from xsched.plan import Plan, SolverInfo
from xsched.profile import Profile
from xsched.simulate import simulate
from xsched.solve.bounds import check_budgets
from xsched.solve.eager import eager_peak
from xsched.solve.heuristics import HEURISTICS, best_heuristic

if TYPE_CHECKING:
    from xsched.solve.options import SolverOptions

METHODS = ("milp", *HEURISTICS)


def solve(
    graph: Graph,
    profile: Profile,
    budgets: Mapping[str, str | int],
    devices: Sequence[str] | None = None,
    method: str = "milp",
    options: SolverOptions | None = None,
    homes: Mapping[str, str] | None = None,
    warm_start: Plan | None = None,
) -> Plan:
    """A plan for `graph` on `devices` within `budgets` ("4GiB", "16GB", bytes, or "50%" of the eager peak).

    devices: default the budgets' keys, else the profile's devices. homes: where each graph input
    lives; every graph input not named there (by default all of them) lives on the first device. method: "milp" (warm-started from the best
    heuristic that fits; if the MILP finds no incumbent in its time limit, or only one slower than
    that heuristic plan, the heuristic plan is returned with status "heuristic" and
    extra["fallback_from"] == "milp"; with neither, NoIncumbent is raised) or one of the heuristics
    "eager", "greedy", "fastest", "sqrt", "checkpoint", "offload". warm_start: a plan of the caller's (same graph
    and homes) that competes with the heuristics for the MILP's warm start when it meets these budgets.
    """
    if method not in METHODS:
        raise XschedError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}", stage="solve")
    profile.check_graph(graph.fingerprint)
    parsed = parse_budgets(budgets, lambda: eager_peak(graph))
    devices = list(devices) if devices is not None else list(parsed) or list(profile.devices)
    if not devices:
        raise XschedError("no devices: give budgets or devices, or a profile with devices", stage="solve")
    for d in parsed:
        if d not in devices:
            raise BudgetError(
                f"budget given for {d}, which is not among the devices {devices}", stage="solve", device=d
            )
    homes = {v: devices[0] for v in graph.inputs} | dict(homes or {})
    stray = [v for v in homes if v not in graph.value or v in graph.producer]
    if stray:
        raise PlanError("home given for a value that is not a graph input", stage="solve", value=stray[0])
    check_budgets(graph, profile, parsed, devices, homes)
    if method == "milp":
        plan = _milp(graph, profile, parsed, devices, homes, options, warm_start)
    else:
        plan = HEURISTICS[method](graph, profile, parsed, devices, homes)
    return validated(graph, plan, profile, parsed)


def validated(graph: Graph, plan: Plan, profile: Profile, budgets: Mapping[str, int]) -> Plan:
    """The plan under `budgets`, replayed by the simulator (PlanError if invalid), with its predicted figures."""
    plan = replace(plan, budgets=dict(budgets))
    result = simulate(graph, plan, profile)
    return replace(plan, predicted=result.prediction())


def _milp(
    graph: Graph,
    profile: Profile,
    budgets: Mapping[str, int],
    devices: Sequence[str],
    homes: Mapping[str, str],
    options: SolverOptions | None,
    given: Plan | None = None,
) -> Plan:
    from xsched.solve.milp import NoIncumbent, solve_milp
    from xsched.solve.options import SolverOptions

    t0 = time.perf_counter()
    warm, why_not = best_heuristic(graph, profile, budgets, devices, homes)
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
    options = options or SolverOptions()
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

    def fall_back(reason: str, milp: Mapping[str, object] | None = None) -> Plan:
        extra = {**warm.solver.extra, **(milp or {}), **context, "fallback_from": "milp", "reason": reason}
        info = SolverInfo(warm.solver.method, "heuristic", None, time.perf_counter() - t0, extra)
        return replace(warm, solver=info)

    try:
        plan = solve_milp(graph, profile, budgets, devices, homes, options, warm_start=warm)
    except NoIncumbent as e:
        if warm is None:
            reasons = "; ".join(f"{k}: {v}" for k, v in why_not.items())
            raise NoIncumbent(f"{e.detail}, and no heuristic meets the budgets either ({reasons})") from e
        return fall_back(str(e))
    plan = validated(graph, plan, profile, budgets)
    if warm is not None and _objective(warm, options) < _objective(plan, options) * (1 - 1e-9):
        # a solver that stops early (or drops the start) can return an incumbent worse than the start it was given
        return fall_back(
            f"the MILP's plan ({plan.solver.status}, gap {plan.solver.gap}) takes {plan.predicted.time_s:.6g} s, "
            f"its warm start {warm.predicted.time_s:.6g} s",
            {**plan.solver.extra, "milp_status": plan.solver.status, "milp_gap": plan.solver.gap},
        )
    return replace(plan, solver=replace(plan.solver, extra={**plan.solver.extra, **context}))


def _objective(plan: Plan, options: SolverOptions) -> float:
    """What the MILP minimises, from the simulator's figures: time + alpha x energy."""
    p = plan.predicted
    return (p.time_s or 0.0) + options.alpha_energy * (p.energy_j or 0.0)
