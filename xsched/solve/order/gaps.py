"""`order-gaps`: the order search (`order.search_order`) with each order scored by gap rematerialization (one
device: hundreds of orders in the time CP-SAT scores a few). Measured in scripts/bench_solver.py
(docs/bench/solver.md): on random_layered_n100 at M = 37,055, it reached 0.65% where `order-cpsat` reached 1.52%."""

from __future__ import annotations

from xsched.contracts.plan import Plan
from xsched.solve.heuristics.gaps import order_scorer
from xsched.solve.options import DEFAULTS, SolverOptions
from xsched.solve.order.order import searched, starting_orders
from xsched.solve.problem import Outcome, Problem

GAPS_TRY_S = 0.01  # the gaps scorer has no time limit of its own: a short one per order, so the search moves on


def run_gaps(problem: Problem, options: SolverOptions = DEFAULTS, warm: Plan | None = None) -> Outcome:
    """The best gaps plan over the starting orders and local moves from the best, within the time limit."""
    graph, alpha = problem.graph, options.alpha_energy
    score = order_scorer(
        graph, problem.profile, problem.budgets, problem.computing[0], problem.homes, alpha, problem.devices
    )
    tries = len(starting_orders(graph, warm))
    return searched("order-gaps", problem, options, warm, score, dict(per_try_s=GAPS_TRY_S, give_up=tries))
