"""The `sqrt` heuristic: Chen et al.'s sqrt(n) checkpointing on the best single device whose plan fits."""

from __future__ import annotations

from xsched.contracts.plan import Plan
from xsched.solve.heuristics.checkpoint import checkpoint_plan, sqrt_keep
from xsched.solve.heuristics.routing import best_single_device
from xsched.solve.options import DEFAULTS, SolverOptions
from xsched.solve.problem import Problem


def sqrt_checkpoint(problem: Problem, options: SolverOptions = DEFAULTS, warm: Plan | None = None) -> Plan:
    """sqrt(n) checkpointing on the fastest single device whose plan fits the budgets."""
    graph, profile = problem.graph, problem.profile
    keep = sqrt_keep(graph)

    def on(d: str) -> Plan:
        return checkpoint_plan(
            graph, keep, d, profile, budgets=problem.budgets, homes=problem.homes, name="sqrt", via=problem.devices
        )

    return best_single_device(on, graph, profile, problem.devices, "sqrt", options.alpha_energy)
