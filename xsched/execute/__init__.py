"""Execution of plans: the reference interpreter, the multi-stream executor and the drop-in module."""

from xsched.execute.executor import Executor
from xsched.execute.reference import RunTrace, execute, run_plan
from xsched.execute.run_report import RunReport, measure
from xsched.execute.steps import STEP_KINDS, RunState
from xsched.execute.wrap import XschedModule, wrap

__all__ = [
    "STEP_KINDS",
    "Executor",
    "RunReport",
    "RunState",
    "RunTrace",
    "XschedModule",
    "execute",
    "measure",
    "run_plan",
    "wrap",
]
