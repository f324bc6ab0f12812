"""xsched: place, keep or recompute each operator of a training graph across CPU and GPUs under memory budgets."""

from xsched.errors import BudgetError, CaptureError, GraphError, PlanError, ProfileError, XschedError
from xsched.graph import Graph, Op, Value
from xsched.plan import Compute, Copy, Free, Plan
from xsched.profile import Profile
from xsched.simulate import SimResult, simulate

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
]
