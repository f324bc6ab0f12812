"""Two solvers built on the order search (`order.search_order`): each order scored by gap rematerialization
(`order-gaps`, one device: hundreds of orders in the time CP-SAT scores a few) or by CP-SAT on the interval model
(`order-cpsat`). Measured in scripts/bench_solver.py (docs/bench/solver.md): on random_layered_n100 at M = 37,055,
the gaps-scored search reached 0.65% where the CP-SAT-scored one reached 1.52%."""

from __future__ import annotations

import time
from dataclasses import replace

from xsched.contracts.plan import Plan
from xsched.contracts.result import OrderSearchStats, SolveResult, Times
from xsched.solve.heuristics.gaps import order_scorer
from xsched.solve.objective import objective
from xsched.solve.options import DEFAULTS, SolverOptions
from xsched.solve.order.order import search_order, starting_orders
from xsched.solve.problem import Outcome, Problem

GAPS_TRY_S = 0.01  # the gaps scorer has no time limit of its own: a short one per order, so the search moves on
GIVE_UP_OPS = 300  # beyond this the CP-SAT-scored search stops when its first order gives no plan


def run_gaps(problem: Problem, options: SolverOptions = DEFAULTS, warm: Plan | None = None) -> Outcome:
    """The best gaps plan over the starting orders and local moves from the best, within the time limit."""
    graph, alpha = problem.graph, options.alpha_energy
    score = order_scorer(graph, problem.profile, problem.budgets, problem.computing[0], problem.homes, alpha)
    tries = len(starting_orders(graph, warm))
    return _searched("order-gaps", problem, options, warm, score, dict(per_try_s=GAPS_TRY_S, give_up=tries))


def run_cpsat(problem: Problem, options: SolverOptions = DEFAULTS, warm: Plan | None = None) -> Outcome:
    """The best CP-SAT interval plan (C = 2) over the starting orders and local moves, within the time limit."""
    from xsched.solve.intervals import solve_intervals

    def score(order: tuple[int, ...], seconds: float) -> Plan:
        opts = replace(options, time_limit_s=seconds)
        workers = options.solver_threads or 0
        return solve_intervals(problem, opts, warm, order=order, c_max=2, seed=options.seed, workers=workers)

    big = len(problem.graph.ops) > GIVE_UP_OPS  # a first plan may take all the time there: no time for other orders
    return _searched("order-cpsat", problem, options, warm, score, dict(give_up=1 if big else None))


def _searched(name: str, problem: Problem, options: SolverOptions, warm: Plan | None, score, kw) -> Outcome:
    t0 = time.perf_counter()
    limit = options.time_limit_s if options.time_limit_s is not None else 3600.0
    found, _, stats = search_order(problem.graph, score, limit, warm, options.seed, options.alpha_energy, **kw)
    stats = replace(stats, scorer=name.split("-")[1])
    times = Times(solve_s=time.perf_counter() - t0)
    if found is None:
        return Outcome(SolveResult(name, "no_incumbent", times=times, stats=stats, message=_why(stats)))
    value = objective(found, options.alpha_energy)
    return Outcome(SolveResult(name, "heuristic", value, times=times, stats=stats), found)


def _why(stats: OrderSearchStats) -> str:
    return f"no order gave a plan ({stats.orders_tried} scored in {stats.search_s:.1f} s)"
