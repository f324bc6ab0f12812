"""`order-cpsat`: the order search (`order.search_order`) with each order scored by CP-SAT on the interval model
(C = 2), from the warm start's order on."""

from __future__ import annotations

from dataclasses import replace

from xsched.contracts.plan import Plan
from xsched.solve.options import DEFAULTS, SolverOptions
from xsched.solve.order.order import searched
from xsched.solve.problem import Outcome, Problem

GIVE_UP_OPS = 300  # beyond this the CP-SAT-scored search stops when its first order gives no plan


def run_cpsat(problem: Problem, options: SolverOptions = DEFAULTS, warm: Plan | None = None) -> Outcome:
    """The best CP-SAT interval plan (C = 2) over the starting orders and local moves, within the time limit."""
    from xsched.solve.intervals.solver import solve_intervals

    def score(order: tuple[int, ...], seconds: float) -> Plan:
        opts = replace(options, time_limit_s=seconds)
        workers = options.solver_threads or 0
        return solve_intervals(problem, opts, warm, order=order, c_max=2, seed=options.seed, workers=workers)

    big = len(problem.graph.ops) > GIVE_UP_OPS  # a first plan may take all the time there: no time for other orders
    kw = dict(give_up=1, first_whole=True) if big else dict(give_up=None)
    return searched("order-cpsat", problem, options, warm, score, kw)
