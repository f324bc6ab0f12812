"""Solvers: each turns a graph, a profile and budgets into a simulator-checked `Plan`."""

from xsched.solve.eager import eager_plan

__all__ = ["eager_plan"]
