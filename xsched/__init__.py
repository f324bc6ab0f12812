"""xsched: place, keep or recompute each operator of a training graph across CPU and GPUs under memory budgets."""

from xsched.contracts.graph import Graph, Op, Value
from xsched.contracts.plan import Compute, Copy, Free, Plan
from xsched.contracts.profile import Profile
from xsched.errors import BudgetError, CaptureError, GraphError, PlanError, ProfileError, XschedError
from xsched.simulate import SimResult, simulate


def __getattr__(name: str):  # lazy: solving imports Pyomo, wrapping imports the executor
    import importlib

    if name == "solve":
        return importlib.import_module("xsched.solve")  # a callable package: xsched.solve(graph, profile, budgets)
    if name == "wrap":
        return importlib.import_module("xsched.execute.wrap").wrap
    raise AttributeError(f"module 'xsched' has no attribute {name!r}")


__all__ = [
    "BudgetError",
    "CaptureError",
    "Compute",
    "Copy",
    "Free",
    "Graph",
    "GraphError",
    "Op",
    "Plan",
    "PlanError",
    "Profile",
    "ProfileError",
    "SimResult",
    "Value",
    "XschedError",
    "simulate",
    "solve",
    "wrap",
]
