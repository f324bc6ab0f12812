"""The retention-interval solver for a fixed order: CP-SAT or HiGHS (linearised), with C, the number of intervals
per value and device, raised while it pays and time remains; the registry's `intervals-cpsat` and `intervals-highs`."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import replace

from xsched.contracts.graph import Graph
from xsched.contracts.plan import Plan
from xsched.contracts.profile import Profile
from xsched.contracts.result import IntervalStats, SolveResult, Times
from xsched.errors import BudgetError, NoIncumbent
from xsched.solve.intervals.cpsat import Outcome, solve_cpsat
from xsched.solve.intervals.data import IntervalData, Late, build_data
from xsched.solve.intervals.extract import hint_from_plan, step_counts, to_plan
from xsched.solve.objective import better, objective
from xsched.solve.options import DEFAULTS, SolverOptions, late_after, now, past_deadline
from xsched.solve.order.order import first_compute_indices, topological, unbudgeted_plan
from xsched.solve.problem import Problem
from xsched.solve.registry import from_plan

BACKENDS = ("cpsat", "highs")
HARD_SHARE = 0.25  # without a plan to start from: this share of the time on the model as it is, then
SOFT_SHARE = 0.8  # at most this share of the rest for the soft-budget phase (it stops at its first plan)
C_START, C_MAX = 2, 4  # Moccasin finds C = 2 enough in practice; more only while it pays and time remains


def solve_intervals(
    problem: Problem,
    options: SolverOptions = DEFAULTS,
    warm_start: Plan | None = None,
    *,
    backend: str = "cpsat",
    order: Sequence[int] | None = None,
    seed: int = 0,
    workers: int = 0,
    c_max: int = C_MAX,
) -> Plan:
    """The best plan of the interval model for `order` (default: the warm start's first-compute order if it is
    topological, else the graph's) within `options.time_limit_s`, checked by the simulator.

    Starts at C = 2 and raises C while the last model was solved to optimality or proven infeasible, the last
    raise paid, time remains and C < c_max. Raises BudgetError when the model is infeasible at the last C tried
    (for this order and C: not a proof for other orders or more intervals) and NoIncumbent when no plan is found
    in time. Its status is "optimal" (and its gap set) only with one device, where the model's objective is the
    makespan; elsewhere a proven model gives "feasible". Its result's stats (IntervalStats) hold C and the model's
    own objective and bound (for this order and C only)."""
    # lateness is read on the solve stage's clock (a test's fake clock included), durations on the wall clock
    t0, start = time.perf_counter(), now()
    limit = options.time_limit_s if options.time_limit_s is not None else 3600.0
    late = late_after(start, limit)
    graph, profile, budgets, devices, homes = (
        problem.graph,
        problem.profile,
        problem.budgets,
        tuple(problem.devices),
        problem.homes,
    )
    if order is None:
        order = tuple(range(len(graph.ops)))
        if warm_start is not None and topological(graph, first_compute_indices(graph, warm_start)):
            order = first_compute_indices(graph, warm_start)
    order = tuple(order)
    # a warm start running this order gets a slot for each of its steps, even past C: a complete hint
    least = step_counts(graph, warm_start, devices) if _fits(warm_start, order, graph) else None
    # CP-SAT times copies on their links (link_time.py) from a plan of this order, where one device computes (a
    # store beside it): from nothing it found no first plan in a minute even on 6 ops; with two computing devices
    # (which it times one after another, as the stage objective does) it proved no optimum of test_auto's 30 s case
    one = sum(1 for d in devices if profile.compute.get(d)) == 1
    timing = "links" if least is not None and one else "stages"
    best: Plan | None = None
    hint = None
    C, times = C_START, {"build_s": 0.0, "solve_s": 0.0, "extract_s": 0.0}
    last: Outcome | None = None
    prev_objective: int | None = None
    out = Outcome("unknown", None, None, None, 0.0, 0.0)  # no model solved yet
    try:
        data: IntervalData | None = build_data(
            graph, profile, budgets, devices, homes, order, C, options.alpha_energy, least, late
        )
    except Late:  # no time left to solve the model
        data = None
    while data is not None:
        if hint is None:  # the warm start if it runs this order, else every op once in this order (over budget)
            hint = (hint_from_plan(data, warm_start) if warm_start is not None else {}) or hint_from_plan(
                data, unbudgeted_plan(graph, order, _fastest(profile, devices), homes)
            )
        left = limit - (now() - start)
        if backend == "cpsat" and best is None and C == C_START and not _fits(warm_start, order, graph):
            # no plan of this order to start from: a short search on the model as it is (often enough), then one
            # with the budgets made soft (bytes over them cost more than any plan's time) from where it stopped
            out = _run(data, backend, HARD_SHARE * left, hint, seed, workers, options, "stages")
            times["build_s"] += out.build_s
            times["solve_s"] += out.solve_s
            if out.placed is None and out.status != "infeasible":
                soft = solve_cpsat(
                    data,
                    SOFT_SHARE * (limit - (now() - start)),
                    workers or (options.solver_threads or 0),
                    seed,
                    hint,
                    soft=True,
                    timing="stages",
                )
                times["build_s"] += soft.build_s
                times["solve_s"] += soft.solve_s
                hint = soft.placed or hint
            if out.status not in ("optimal", "infeasible"):  # the rest of the time, from the best start known
                more = _run(
                    data,
                    backend,
                    limit - (now() - start),
                    out.placed or hint,
                    seed,
                    workers,
                    options,
                    "stages",
                )
                times["build_s"] += more.build_s
                times["solve_s"] += more.solve_s
                out = more if more.placed is not None or out.placed is None else out
        else:
            out = _run(data, backend, left, hint, seed, workers, options, timing)
            times["build_s"] += out.build_s
            times["solve_s"] += out.solve_s
        if out.placed is not None:
            t1 = time.perf_counter()
            # the model's time is an estimate (HiGHS: copies longer than a stage count beyond it; CP-SAT: an upper
            # one but where a link's copies of one stage run in another order than the plan's): its earlier solutions,
            # the completed hint first, are replayed too, and the simulator's best is kept
            for cost, placed in ((out.objective, out.placed), *reversed(out.incumbents)):  # a tie: the latest
                if best is not None and (past_deadline() or now() - start > limit):
                    break  # each replay is a simulator run (0.3 s on GPT-2 1.56B): the deadline keeps the plan kept
                plan = to_plan(data, placed, SolveResult(f"intervals-{backend}", "feasible"))
                if better(plan, best, options.alpha_energy):
                    # an earlier solution of the model is not its optimum: reported as feasible
                    best, last = plan, out if placed is out.placed else replace(out, objective=cost, status="feasible")
                    best_data = data
            times["extract_s"] += time.perf_counter() - t1
            hint = out.placed
        if out.status not in ("optimal", "infeasible") or C >= c_max or now() - start > 0.5 * limit:
            break  # stopped by the time limit, or no C left: more intervals would not get their time
        if out.status == "optimal" and prev_objective is not None and out.objective >= prev_objective:
            break  # C + 1 intervals did not pay: the last two optima are equal
        prev_objective = out.objective if out.status == "optimal" else None
        C += 1
        try:
            lifted = build_data(graph, profile, budgets, devices, homes, order, C, options.alpha_energy, least, late)
        except Late:  # no time left for C + 1 intervals: the plan of C stands
            break
        hint = _lift(out.placed, data, lifted) if out.placed else None
        data = lifted
    if best is None and out.status == "infeasible":
        raise BudgetError(
            f"the interval model (this order of {len(order)} ops, up to C = {C} intervals) has no plan "
            "within the budgets",
            stage="solve",
            device=devices[0] if len(devices) == 1 else None,
        )
    if best is None or last is None:
        raise NoIncumbent(f"intervals-{backend} found no plan in {time.perf_counter() - t0:.1f} s ({out.status})")
    # the model's objective is an upper estimate of its plans' makespans (data.py), exact with one device only:
    # elsewhere its proof and gap say nothing of the plan's makespan against the model's other plans (they stay in
    # the stats, as the model's own), so a proven model gives a plan that is only "feasible"
    exact = len(devices) == 1
    gap = None
    if exact and last.bound is not None and last.objective:
        gap = max(0.0, last.objective - last.bound) / last.objective
    status = "time_limit" if last.status != "optimal" else "optimal" if exact else "feasible"
    stats = IntervalStats(
        backend=backend,
        intervals=best_data.C,
        order_kept=first_compute_indices(graph, best) == order,
        model_objective=best_data.objective_s(last.objective) if last.objective is not None else None,
        model_bound=best_data.objective_s(last.bound) if last.bound is not None else None,
    )
    spent = time.perf_counter() - t0
    times = Times(times["build_s"], max(0.0, spent - times["build_s"] - times["extract_s"]), times["extract_s"])
    info = SolveResult(f"intervals-{backend}", status, objective(best, options.alpha_energy), None, gap, times, stats)
    return replace(best, solver=info)


# the registry's entries: an infeasible model is a proof for this order and C only, so it is not reported as one
def intervals_cpsat(problem: Problem, options: SolverOptions = DEFAULTS, warm: Plan | None = None) -> Plan:
    """`intervals-cpsat`: the model for the warm start's order (else the graph's), CP-SAT with the options' seed."""
    workers = options.solver_threads or 0
    return solve_intervals(problem, options, warm, seed=options.seed, workers=workers)


def intervals_highs(problem: Problem, options: SolverOptions = DEFAULTS, warm: Plan | None = None) -> Plan:
    """`intervals-highs`: the same model linearised, HiGHS."""
    return solve_intervals(problem, options, warm, backend="highs")


run_cpsat = from_plan(intervals_cpsat, proofs=False)
run_highs = from_plan(intervals_highs, proofs=False)


def _run(
    data: IntervalData,
    backend: str,
    left: float,
    hint,
    seed: int,
    workers: int,
    options: SolverOptions,
    timing: str = "links",
) -> Outcome:
    if backend == "cpsat":
        threads = workers or (options.solver_threads or 0)
        return solve_cpsat(data, left, threads, seed, hint, options.verbose, timing=timing)
    if backend == "highs":
        from xsched.solve.intervals.highs import solve_highs_intervals

        return solve_highs_intervals(data, left, hint, options)
    raise ValueError(f"unknown interval backend {backend!r}; choose one of {BACKENDS}")


def _lift(placed: Mapping, old: IntervalData, new: IntervalData) -> dict:
    """A placement of `old` (C) as one of `new` (C + 1): the same steps, in the slots of the same kind."""

    def key(sl):
        return (sl.kind, sl.op, sl.values, sl.src, sl.device, sl.c)

    index = {key(sl): k for k, sl in enumerate(new.slots)}
    return {index[key(old.slots[k])]: p for k, p in placed.items() if key(old.slots[k]) in index}


def _fits(warm: Plan | None, order: Sequence[int], graph: Graph) -> bool:
    """The warm start is a plan within the budgets running `order`: a complete hint, no soft phase needed."""
    return warm is not None and warm.predicted is not None and first_compute_indices(graph, warm) == tuple(order)


def _fastest(profile: Profile, devices: Sequence[str]) -> str:
    """The device running the most ops, the fastest in total among those: where the order's hint computes."""
    ops = {d: profile.compute.get(d, {}) for d in devices}
    return min(devices, key=lambda d: (-len(ops[d]), sum(c.time_s for c in ops[d].values())))
