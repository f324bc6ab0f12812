"""The solver entry point: parse the problem, run the configuration it names (`auto`, `portfolio`, or one method)
through the runner, and return the simulator-checked plan, which carries the run's typed record."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import replace

from xsched.contracts.graph import Graph
from xsched.contracts.plan import Plan
from xsched.contracts.profile import Profile
from xsched.errors import SolverError
from xsched.solve.bounds.memory import check_budgets
from xsched.solve.objective import objective
from xsched.solve.options import DEFAULTS, SolverOptions, deadline, enough_at
from xsched.solve.problem import Outcome, Problem, runnable
from xsched.solve.registry import SOLVERS, run_member
from xsched.solve.reserved import fit_reserved
from xsched.solve.runner import CONFIGURATIONS, configuration, gap_threshold, run


def solve(
    graph: Graph,
    profile: Profile,
    budgets: Mapping[str, str | int],
    devices: Sequence[str] | None = None,
    method: str = "auto",
    options: SolverOptions | None = None,
    homes: Mapping[str, str] | None = None,
    warm_start: Plan | None = None,
) -> Plan:
    """A plan for `graph` on `devices` within `budgets` ("4GiB", "16GB", bytes, or "50%" of the eager peak); its
    `solver` is the run's typed SolveResult.

    devices: default the budgets' keys, else the profile's devices. homes: where each graph input lives; every
    graph input not named there (by default all of them) lives on the first device.
    method: "auto" (default: the bounds, every heuristic, then every search and exact model that fits, within
    options.time_limit_s), "portfolio" (the same without the hierarchical solver), or a registered method
    (`xsched.solve.SOLVERS`): a heuristic runs alone; any other is warm-started from the best heuristic and
    returns its own plan unless it finds none or one worse than that start, which is then returned with status
    "heuristic" and the reason in `solver.stats.fallback_reason`. warm_start: a plan of the caller's (same graph
    and homes) that competes as a candidate when it meets these budgets; `park-recomputes` alone refines it (among
    the heuristics it refines the best plan so far).
    options.fit_reserved (default off): where a GPU's predicted reserved memory (xsched.allocator, the caching
    allocator's model) exceeds its budget, re-plan at a lower budget (xsched.solve.reserved).
    Raises BudgetError when no plan is found (saying whether none is proven to exist) and NoIncumbent when a
    method stops without a plan and no heuristic fits either.
    """
    return solve_result(graph, profile, budgets, devices, method, options, homes, warm_start).plan


def solve_result(
    graph: Graph,
    profile: Profile,
    budgets: Mapping[str, str | int],
    devices: Sequence[str] | None = None,
    method: str = "auto",
    options: SolverOptions | None = None,
    homes: Mapping[str, str] | None = None,
    warm_start: Plan | None = None,
) -> Outcome:
    """`solve`'s outcome: the run's record (`outcome.record`) and its plan (`outcome.plan`, never None here); it
    raises the same errors."""
    if method not in CONFIGURATIONS and method not in SOLVERS:  # the registry as it is now
        raise SolverError(f"unknown method {method!r}; choose one of {', '.join((*CONFIGURATIONS, *SOLVERS))}")
    problem = Problem.make(graph, profile, budgets, devices, homes)
    options = options or SolverOptions()

    def solve_at(problem: Problem, seconds: float | None) -> Outcome:
        return _solve_once(problem, method, replace(options, time_limit_s=seconds), warm_start)

    if not options.fit_reserved:
        return solve_at(problem, options.time_limit_s)
    return fit_reserved(problem, solve_at, options.time_limit_s, expandable=options.expandable_segments)


def _solve_once(problem: Problem, method: str, options: SolverOptions, warm_start: Plan | None) -> Outcome:
    """One solve of `problem` by `method`: its outcome with a plan, or its error."""
    entry = SOLVERS.get(method)
    if entry is not None and entry.kind == "heuristic":  # alone: its own error when it does not fit
        check_budgets(problem.graph, problem.profile, problem.budgets, problem.devices, problem.homes)
        with deadline(options.time_limit_s):  # a heuristic alone keeps the limit too (its options carry it)
            # a gap asked (`--gap`) stops its variants within it of the lower bound (the bound costs a share of the
            # limit, so it is found only then)
            enough = gap_threshold(problem, options) if options.mip_gap > DEFAULTS.mip_gap else -math.inf
            with enough_at(enough):
                result = run_member(entry, problem, options, warm_start)  # read by one that `refines`
        if result.plan is not None:  # a plan wrap cannot run (forward outputs gone at the boundary): BudgetError
            plan = runnable(problem.graph, result.plan, problem.profile, problem.budgets)
            result = Outcome(replace(plan.solver, objective=objective(plan, options.alpha_energy)), plan)
    else:
        result = run(problem, configuration(method, problem), options, warm_start)
    if result.plan is None:
        raise result.error or SolverError(f"{result.method}: {result.status}: {result.message}")
    return result


METHODS = (*CONFIGURATIONS, *SOLVERS)  # those registered at import

__all__ = ["METHODS", "solve", "solve_result"]
