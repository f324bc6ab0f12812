"""Retention-interval solvers (Moccasin's formulation on several devices) for a fixed order: the model's data
(`data`), its CP-SAT and HiGHS runs (`cpsat`, `highs`), the plan read back (`extract`) and the solver (`solver`)."""

from xsched.solve.intervals.cpsat import available
from xsched.solve.intervals.solver import BACKENDS, run_cpsat, run_highs, solve_intervals

__all__ = ["BACKENDS", "available", "run_cpsat", "run_highs", "solve_intervals"]
