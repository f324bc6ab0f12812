"""Solvers: each turns a graph, a profile and budgets into a simulator-checked `Plan`.

`xsched.solve(graph, profile, budgets, ...)` is `xsched.solve.api.solve`: the package itself is callable,
so the submodules (`xsched.solve.milp`, `.heuristics`, ...) stay reachable under the same name.
"""

import sys
import types

from xsched.solve.api import solve
from xsched.solve.eager import eager_peak, eager_plan
from xsched.solve.options import SolverOptions
from xsched.solve.problem import Problem, SolverEntry, SolveResult
from xsched.solve.registry import SOLVERS, register


class _CallablePackage(types.ModuleType):
    def __call__(self, *args, **kwargs):
        return solve(*args, **kwargs)


sys.modules[__name__].__class__ = _CallablePackage

__all__ = [
    "SOLVERS",
    "Problem",
    "SolveResult",
    "SolverEntry",
    "SolverOptions",
    "eager_peak",
    "eager_plan",
    "register",
    "solve",
]
