"""The `fastest` heuristic: each op on the device where it runs fastest, ignoring copies; then the copies it needs."""

from __future__ import annotations

import time

from xsched.contracts.plan import Compute, Plan
from xsched.errors import BudgetError
from xsched.solve.heuristics.routing import route_and_finish
from xsched.solve.options import DEFAULTS, SolverOptions
from xsched.solve.problem import Problem


def fastest(problem: Problem, options: SolverOptions = DEFAULTS, warm: Plan | None = None) -> Plan:
    """Each op on the device where it runs fastest, ignoring copies; then the copies it needs."""
    t0 = time.perf_counter()
    graph, profile, devices = problem.graph, problem.profile, problem.devices
    assignment = {}
    for op in graph.ops:
        times = [(c.time_s, k, d) for k, d in enumerate(devices) if (c := profile.op_cost(op.id, d)) is not None]
        if not times:
            raise BudgetError(f"op cannot run on any of {', '.join(devices)}", stage="solve", op=op.id)
        assignment[op.id] = min(times)[2]  # the op's own time, not a plan: no objective to rank by
    computes = [Compute(o.id, assignment[o.id]) for o in graph.ops]
    return route_and_finish(
        graph, computes, "fastest", problem.budgets, problem.homes, profile, t0, via=problem.devices
    )
