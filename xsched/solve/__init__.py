"""Solvers: each turns a `Problem` (graph, profile, budgets) into an `Outcome`, its record and a simulator-checked
`Plan` that carries the record (docs/ARCHITECTURE.md, "Solvers").

`xsched.solve(graph, profile, budgets, ...)` is `xsched.solve.api.solve`: the package itself is callable,
so the submodules (`xsched.solve.milp`, `.heuristics`, ...) stay reachable under the same name.

| module | role |
|---|---|
| `api` | `solve`, `solve_result`: parse the problem, run a configuration, return the plan |
| `runner` | the one loop: members in order within one time limit, one ranking, one lower bound, one record |
| `registry` | method name -> `SolverEntry` (kind, sizes, share of the time); the built-in methods, one line each |
| `problem` | `Problem` (what a solver takes), `Outcome` (what it gives), `validated`/`runnable` (how a plan leaves) |
| `options` | `SolverOptions`, the options of every solver |
| `objective` | the one ranking rule (`better`, `best_of`) and the lower bound gaps are measured against |
| `reference` | the eager plan, whose peak a budget written as "50%" refers to |
| `autograd_boundary` | the rule `wrap` needs (forward outputs resident when backward starts), checked and repaired |
| `heuristics/` | one file per heuristic (`eager`, `greedy`, `fastest`, `sqrt`, `checkpoint`, `offload`, `gaps`, `park`, `park_search`), `routing`, `timeline` (the one timeline of those that evict or park) |
| `milp/` | the stage MILP: `stages`, `milp` (model and run), `backends` (HiGHS, Pyomo), `extract` |
| `intervals/` | the retention-interval model for a fixed order; `solver`: `intervals-cpsat`, `intervals-highs` |
| `order/` | starting orders and the order search (`order`); `order-gaps` (`gaps`) and `order-cpsat` (`cpsat`) |
| `hier/` | the hierarchical decomposition (`hier`): partition, block options, the H-ILP |
| `bounds/` | lower bounds: device memory (`memory`, `crossing`), every plan's makespan (`time`) |
"""

import sys
import types

from xsched.contracts.result import SolveResult, Stats
from xsched.solve.api import METHODS, solve, solve_result
from xsched.solve.options import SolverOptions
from xsched.solve.problem import Outcome, Problem
from xsched.solve.reference import eager_peak, eager_plan
from xsched.solve.registry import SOLVERS, SolverEntry, register


class _CallablePackage(types.ModuleType):
    def __call__(self, *args, **kwargs):
        return solve(*args, **kwargs)


sys.modules[__name__].__class__ = _CallablePackage

__all__ = [
    "METHODS",
    "SOLVERS",
    "Outcome",
    "Problem",
    "SolveResult",
    "SolverEntry",
    "SolverOptions",
    "Stats",
    "eager_peak",
    "eager_plan",
    "register",
    "solve",
    "solve_result",
]
