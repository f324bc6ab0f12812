"""Execution of plans: the reference interpreter (xsched.execute.reference)."""

from xsched.execute.reference import RunTrace, execute, run_plan

__all__ = ["RunTrace", "execute", "run_plan"]
