"""Solvers: each turns a graph, a profile and budgets into a simulator-checked `Plan` that carries its run's typed
`SolveResult` (docs/ARCHITECTURE.md, "Solvers").

`xsched.solve(graph, profile, budgets, ...)` is `xsched.solve.api.solve`: the package itself is callable,
so the submodules (`xsched.solve.milp.milp`, `.heuristics`, ...) stay reachable under the same name.
"""

import sys
import types

from xsched.contracts.result import SolveResult, Stats
from xsched.solve.api import METHODS, solve, solve_result
from xsched.solve.options import SolverOptions
from xsched.solve.problem import Problem
from xsched.solve.reference import eager_peak, eager_plan
from xsched.solve.registry import SOLVERS, SolverEntry, register


class _CallablePackage(types.ModuleType):
    def __call__(self, *args, **kwargs):
        return solve(*args, **kwargs)


sys.modules[__name__].__class__ = _CallablePackage

__all__ = [
    "METHODS",
    "SOLVERS",
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
