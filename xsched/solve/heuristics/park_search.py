"""`park-search`: the park heuristic's greedy over more variants within the time limit (the warm start's own order,
aims below the budget, seeded draws with jittered scores), until PATIENCE draws in a row find nothing faster."""

from __future__ import annotations

import itertools
import random
import time
from collections.abc import Iterator

from xsched.contracts.plan import Plan
from xsched.contracts.result import SolveResult, Times
from xsched.errors import BudgetError, NoIncumbent
from xsched.solve.heuristics.park import park_pairs, park_variant
from xsched.solve.objective import better, objective
from xsched.solve.options import (
    DEFAULTS,
    SolverOptions,
    note_unit,
    now,
    out_of_time,
    past_deadline,
    past_run_end,
    run_left,
    unit_s,
)
from xsched.solve.order.order import starting_orders
from xsched.solve.problem import Outcome, Problem

PATIENCE = 24  # park-search stops after this many draws in a row without a faster plan: a deterministic end


def park_search(problem: Problem, options: SolverOptions = DEFAULTS, warm: Plan | None = None) -> Outcome:
    """`park-search`: more variants than the heuristic's, within the time limit: the warm start's own order too, the
    greedy aiming below the budget (it stops at a different point, sometimes a faster one), and seeded draws of the
    greedy with jittered scores, until PATIENCE draws in a row find nothing faster (or the time limit). Its first
    run of the greedy, which gives nothing if cut short, may end past its own deadline: without a warm start it is
    made however late (the caller has no plan otherwise); with one, it is made only where the run's time left covers
    what a run of the greedy takes in this run (`unit_s`, `run_left`), and stopped at the run's limit. Later runs are
    started and stopped by its own deadline."""
    t0 = time.perf_counter()
    limit = options.time_limit_s if options.time_limit_s is not None else 3600.0
    graph, profile, budgets, homes = problem.graph, problem.profile, problem.budgets, problem.homes
    try:
        pairs = park_pairs(graph, profile, problem.devices)
    except BudgetError as e:
        return Outcome(SolveResult("park-search", "failed", message=e.detail, error=e))
    if warm is not None and (late := _too_late()) is not None:
        return Outcome(SolveResult("park-search", "no_incumbent", message=late))
    orders = dict(starting_orders(graph, warm))
    runs = [(c, store, name, order) for c, store in pairs for name, order in orders.items()]
    best: Plan | None = None
    tried = idle = 0
    stopped = False
    for aim, price, depth, seed in _search_variants(options.seed):
        if stopped or idle >= PATIENCE:
            break
        before = best
        for c, store, name, order in runs:
            if stopped := tried > 0 and (out_of_time() or time.perf_counter() - t0 > limit):
                break
            jitter = random.Random(f"{seed}/{c}/{store}/{name}") if seed is not None else None
            # the first run may end past this member's deadline (cut short it gives nothing): with a warm start it is
            # stopped at the run's limit, without one not at all (the caller has no plan otherwise)
            stop = past_deadline if tried else past_run_end if warm is not None else None
            started, tried = now(), tried + 1
            try:
                plan = park_variant(
                    graph, profile, budgets, homes, c, store, name, order, depth, price, aim, t0, jitter, stop
                )
            except BudgetError:
                plan = None
            except NoIncumbent:  # stopped part-way at the deadline: the best so far is the result
                stopped = True
                break
            note_unit("park", now() - started)  # a whole run, fitting or not
            if plan is not None and better(plan, best, options.alpha_energy):
                best = plan
        if seed is not None:
            idle = 0 if best is not before else idle + 1
    times = Times(solve_s=time.perf_counter() - t0)
    if best is None:
        return Outcome(
            SolveResult("park-search", "no_incumbent", times=times, message=f"no variant fits ({tried} tried)")
        )
    value = objective(best, options.alpha_energy)
    return Outcome(SolveResult("park-search", "heuristic", value, times=times, stats=best.solver.stats), best)


def _too_late() -> str | None:
    """Why the first run of the greedy does not start: the run's time left is shorter than what a run takes in this
    run (the median of park's, before this member); None where it is not."""
    left, unit = run_left(), unit_s("park")
    if left > unit:
        return None
    return f"not started: a run of the park greedy takes {unit:.2f} s in this solve, {max(left, 0.0):.2f} s left"


# (share of the budget aimed at, link price, rerun depth), most promising first (GPT-2 on the H200 profile at 45%,
# 57 GB/s: 1.196x eager aiming at the budget, 1.185x at 98% of it, 1.181x at 95%)
SEARCH_VARIANTS = tuple(
    (aim, price, depth)
    for aim in (0.95, 0.98, 1.0, 0.9, 0.96, 0.99, 0.93)
    for price in (0.1, 0.0, 0.25, 0.05)
    for depth in (4, 0)
)
JITTERED = ((1.0, 0.1, 4), (0.98, 0.1, 4), (0.95, 0.1, 4), (1.0, 0.15, 4))  # those the draws start from


def _search_variants(seed: int) -> Iterator[tuple[float, float, int, int | None]]:
    """(aim, price, depth, draw seed or None): the first fixed variants, then the rest of them alternating with
    rounds of JITTERED drawn with seeds from `seed` on, then draws without end."""
    fixed = [(*v, None) for v in SEARCH_VARIANTS]
    drawn = ((*v, seed + k) for k in itertools.count() for v in JITTERED)
    rest = itertools.chain.from_iterable(itertools.zip_longest(fixed[4:], itertools.islice(drawn, len(fixed) - 4)))
    return itertools.chain(fixed[:4], (v for v in rest if v is not None), drawn)
