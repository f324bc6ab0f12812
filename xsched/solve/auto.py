"""`method="auto"`: the bound check, every heuristic (the best is the warm start), then the exact solver within the
time limit; the best simulator-checked plan with its status and a gap against a lower bound, or one BudgetError
saying whether no plan is *proven* or only *not found*, with the budgets known to work and known not to."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import replace

from xsched.budgets import format_bytes
from xsched.contracts.plan import Plan, SolverInfo
from xsched.errors import BudgetError, XschedError
from xsched.solve.memory_bounds import check_budgets, lower_bounds
from xsched.solve.options import SolverOptions
from xsched.solve.problem import Problem, SolveResult, first_order, objective, runnable
from xsched.solve.registry import HIER_MIN_SIZE, SOLVERS

# (method, share of the time left, smallest and largest ops x devices it runs on here): registered and available
# ones run, each from the best plan so far
EXACT_SEQUENCE = (
    ("milp", 0.5, 0, 60),
    ("hier", 0.4, HIER_MIN_SIZE, 10**9),
    ("portfolio", 1.0, 0, 10**9),
    ("milp", 1.0, 0, 10**9),
)
_PROOF_SCOPE = {"milp": ", for plans that first compute the ops in graph order"}
NO_LIMIT_S = 3600.0  # time_limit_s=None: an hour
PROBE_SHARE, PROBE_MAX_S = 0.2, 10.0  # time for finding a budget that works, after no plan was found
PROBE_FACTORS = (1.1, 1.25, 1.5, 2.0, 4.0)  # budgets scaled by these until a heuristic fits
MIN_MEMBER_S = 0.5  # an exact member is not started with less time left: building its model alone takes longer


def solve_auto(problem: Problem, options: SolverOptions, given: Plan | None = None) -> Plan:
    """The best plan `auto` finds within `options.time_limit_s`; solver.extra says which member found it, the
    lower bound (and what sets it), each member's outcome and the order the plan first computes the ops."""
    t0 = time.perf_counter()
    limit = options.time_limit_s if options.time_limit_s is not None else NO_LIMIT_S
    try:
        check_budgets(*problem.args())
    except BudgetError as e:
        raise _no_plan(problem, f"proven infeasible ({e.detail.split('. Smallest')[0]})", None, limit, e) from e
    members: dict[str, str] = {}
    best, found_by = None, None
    for name, entry in SOLVERS.items():
        if entry.kind != "heuristic":
            continue
        r = entry.fn(problem, options, None)
        members[name] = r.status if r.plan is None else f"{r.plan.predicted.time_s:.6g} s"
        best, found_by = _better(problem, options, best, found_by, r.plan, name)
    if given is not None and dict(given.homes) == dict(problem.homes):
        try:
            best, found_by = _better(problem, options, best, found_by, given, "warm start")
        except XschedError as e:  # over these budgets or not for this graph: not a candidate
            members["warm start"] = e.detail
    floor = _floor(problem, options)
    results: list[SolveResult] = []
    for name, share in _exact_methods(problem):
        left = limit - (time.perf_counter() - t0)
        if left < MIN_MEMBER_S or (best is not None and objective(best, options) <= floor * (1 + 1e-9)):
            break  # no time left, or a plan as fast as every op at its cheapest: nothing to gain
        if results and results[-1].status == "optimal" and found_by == results[-1].method:
            break  # proven optimal (in the stage MILP's formulation: plans in graph order)
        # hier without its CP-SAT refinement: the portfolio after it runs CP-SAT from its plan anyway
        r = SOLVERS[name].fn(problem, replace(options, time_limit_s=left * share, hier_refine=False), best)
        results.append(r)
        members[name] = r.status
        best, found_by = _better(problem, options, best, found_by, r.plan, name)
    if best is None:
        proofs = [r for r in results if r.status == "infeasible"]
        if proofs:
            why = (
                f"proven infeasible by {proofs[0].method} ({proofs[0].message}{_PROOF_SCOPE.get(proofs[0].method, '')})"
            )
        else:
            why = f"not found within the time limit ({limit:g} s; {', '.join(f'{k}: {v}' for k, v in members.items())})"
        raise _no_plan(problem, why, proofs[0] if proofs else None, limit - (time.perf_counter() - t0), None)
    return _labelled(problem, options, best, found_by, results, floor, members, time.perf_counter() - t0)


def _better(
    problem: Problem, options: SolverOptions, best: Plan | None, by: str | None, plan: Plan | None, name: str
) -> tuple[Plan | None, str | None]:
    """The faster (time + alpha x energy) of the best plan so far and `plan` (checked by the simulator first)."""
    if plan is None:
        return best, by
    try:
        plan = runnable(problem.graph, plan, problem.profile, problem.budgets)  # an invalid plan (a bug) propagates
    except BudgetError:
        return best, by  # valid, but wrap could not return its forward outputs: not a candidate

    if options.energy_cap_j is not None and (plan.predicted.energy_j or 0.0) > options.energy_cap_j:
        return best, by
    if best is None or objective(plan, options) < objective(best, options) * (1 - 1e-12):
        return plan, name
    return best, by


def _exact_methods(problem: Problem) -> list[tuple[str, float]]:
    """The exact solvers to run, each with its share of the time left: on small graphs the stage MILP first (it
    proves optimality or infeasibility, for plans in graph order, within seconds there), from HIER_MIN_SIZE on the
    hierarchical solver, then the portfolio (other orders, CP-SAT) from the best plan so far; the registry's size
    thresholds decide the rest (above EXACT_MAX_SIZE only the hierarchical solver runs)."""
    plan = []
    for name, share, min_size, max_size in EXACT_SEQUENCE:
        entry = SOLVERS.get(name)
        if entry is not None and entry.available() and entry.fits(problem) and min_size <= problem.size <= max_size:
            plan.append((name, share))
    if plan:
        plan[-1] = (plan[-1][0], 1.0)  # the last one gets all the time that is left
    return plan


def _floor(problem: Problem, options: SolverOptions) -> float:
    """Every op once on its cheapest device, no copies: a lower bound for every plan in every order."""
    graph, profile, _, devices, _ = problem.args()
    total = 0.0
    for o in graph.ops:
        costs = [c for d in devices if (c := profile.op_cost(o.id, d)) is not None]
        total += min(c.time_s + options.alpha_energy * (c.energy_j or 0.0) for c in costs)
    return total


def _labelled(
    problem: Problem,
    options: SolverOptions,
    best: Plan,
    found_by: str | None,
    results: list[SolveResult],
    floor: float,
    members: Mapping[str, str],
    seconds: float,
) -> Plan:
    """`best` with auto's status, gap and bound. The bound is the larger of the per-op floor (valid for every plan)
    and the stage MILP's bound, which holds for its formulation (first computes in graph order; extraction can
    then prune a plan below it, so it is capped at the plan's objective)."""
    order = list(first_order(best))
    value = objective(best, options)
    bound, source = floor, "every op once at its cheapest"
    milp_bounds = [r.extra["milp_bound"] for r in results if r.extra.get("milp_bound") is not None]
    if milp_bounds and max(milp_bounds) > bound:
        bound, source = min(float(max(milp_bounds)), value), "the stage MILP's bound (first computes in graph order)"
    gap = max(0.0, value - bound) / value if value > 0 else 0.0
    proven = any(r.status == "optimal" and r.method == found_by for r in results)
    if gap <= options.mip_gap or proven:
        status = "optimal"
    else:
        status = "time_limit" if results else "heuristic"
    extra = {
        **best.solver.extra,
        "found_by": found_by,
        "found_by_status": best.solver.status,
        "exact": [r.method for r in results],
        "bound": bound,
        "bound_source": source,
        "members": dict(members),
        "order": order,
    }
    return replace(best, solver=SolverInfo("auto", status, gap, seconds, extra))


def _no_plan(
    problem: Problem, why: str, exact: SolveResult | None, seconds: float, cause: BudgetError | None
) -> BudgetError:
    """One short BudgetError: why there is no plan, the smallest budgets known to work, the largest known not to."""
    budgets = problem.budgets
    lows = lower_bounds(*[problem.graph, problem.profile, problem.devices, problem.homes])
    if exact is not None and exact.status == "infeasible":
        fails = ", ".join(f"{d} {format_bytes(b)}" for d, b in budgets.items())
    else:
        fails = ", ".join(f"{d} {format_bytes(max(lows[d].bytes - 1, 0))}" for d in budgets) + " (lower bound)"
    works = _known_to_work(problem, min(PROBE_MAX_S, max(PROBE_SHARE * seconds, 1.0)))
    msg = f"no plan within the budgets: {why}; smallest budget known to work: {works}; largest known not to: {fails}"
    device = cause.device if cause is not None else (next(iter(budgets)) if len(budgets) == 1 else None)
    return BudgetError(msg, stage="solve", device=device, op=cause.op if cause is not None else None)


def _known_to_work(problem: Problem, seconds: float) -> str:
    """The peaks of the first heuristic plan found at budgets scaled up by PROBE_FACTORS (within `seconds`)."""
    t0 = time.perf_counter()
    for f in PROBE_FACTORS:
        if time.perf_counter() - t0 > seconds:
            break
        bigger = problem.with_budgets({d: int(b * f) for d, b in problem.budgets.items()})
        for entry in SOLVERS.values():
            if entry.kind == "heuristic":
                r = entry.fn(bigger, SolverOptions(), None)
                if r.plan is not None:
                    peaks = r.plan.predicted.peak_bytes
                    return ", ".join(f"{d} {format_bytes(peaks.get(d, 0))}" for d in problem.budgets) + (
                        f" ({r.plan.solver.method})"
                    )
    return "none found"
