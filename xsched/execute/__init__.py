"""Execution of plans: the reference interpreter, the multi-stream executor and the drop-in module."""

from xsched.execute.executor import STEP_KINDS, Executor, RunState
from xsched.execute.reference import RunTrace, execute, run_plan
from xsched.execute.report import RunReport, cli_run, measure
from xsched.execute.wrap import XschedModule, cost_profile, wrap

__all__ = [
    "STEP_KINDS",
    "Executor",
    "RunReport",
    "RunState",
    "RunTrace",
    "XschedModule",
    "cli_run",
    "cost_profile",
    "execute",
    "measure",
    "run_plan",
    "wrap",
]
