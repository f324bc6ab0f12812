"""The `eager` heuristic: the eager schedule on each single device (inputs copied in from their homes); the best
that fits."""

from __future__ import annotations

import time

from xsched.contracts.plan import Compute, Plan
from xsched.contracts.result import HeuristicStats
from xsched.solve.heuristics.routing import best_single_device, route_and_finish
from xsched.solve.options import DEFAULTS, SolverOptions
from xsched.solve.problem import Problem


def eager(problem: Problem, options: SolverOptions = DEFAULTS, warm: Plan | None = None) -> Plan:
    """The eager schedule on each single device (inputs copied in from their homes); the fastest that fits."""
    graph, profile = problem.graph, problem.profile

    def on(d: str) -> Plan:
        t0 = time.perf_counter()
        computes = (Compute(o.id, d) for o in graph.ops)
        stats = HeuristicStats(device=d)
        return route_and_finish(
            graph, computes, "eager", problem.budgets, problem.homes, profile, t0, stats, via=problem.devices
        )

    return best_single_device(on, graph, profile, problem.devices, "eager", options.alpha_energy)
