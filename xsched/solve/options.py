"""Options of every solver (which Pyomo solver, its limits, the objective's energy terms, the HiGHS search knobs), and
the clock and deadline every member checks."""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from xsched.contracts.plan import Plan
    from xsched.solve.problem import Problem


@dataclass(frozen=True)
class SolverOptions:
    """How a solver runs. Times in seconds (`time_limit_s`: the whole solve, for `auto` too), energies in joules."""

    solver: str = "highs"  # any Pyomo solver name: "highs" (appsi_highs), "gurobi", "cbc", ... when installed
    time_limit_s: float | None = 60.0
    # HiGHS's branch-and-bound nodes per run (stage MILP): with one thread and no time limit, a deterministic stop
    node_limit: int | None = None
    mip_gap: float = 1e-4  # relative gap
    solver_threads: int | None = None  # threads of HiGHS and CP-SAT (None: the solver's default)
    alpha_energy: float = 0.0  # objective = time + alpha * energy
    energy_cap_j: float | None = None
    fix_homes: bool = True  # False: the solver picks params' home devices
    # re-plan at a lower budget while a GPU's reserved memory (caching allocator model) exceeds its budget. Off by
    # default: with copies' blocks held to the step's end (the model's upper end), no GPT-2 store plan fits its
    # budget (xsched.solve.reserved)
    fit_reserved: bool = False
    # the plan runs with CUDA's expandable segments (the executor's option of that name): fit_reserved replays it on
    # that allocator model, not the default settings'
    expandable_segments: bool = False
    verbose: bool = False
    seed: int = 0  # CP-SAT's random seed (one worker: a run is deterministic for a seed); park-search's draws
    hier_processes: int | None = None  # hier: processes solving independent blocks (None: the core count)
    hier_refine: bool = True  # hier: CP-SAT refines its plan in the time left (auto: off, its portfolio follows)
    # stage MILP on HiGHS: LP-guided restricted searches before the full one, as (producer levels around the LP's
    # recomputes, share of the time left); () searches the full model only
    restricted: tuple[tuple[int, float], ...] = ((0, 0.25), (1, 0.5))
    lp_share: float = 0.25  # share of the time left for the LP relaxation guiding the restricted searches (0: none)


DEFAULTS = SolverOptions()  # frozen: the one shared default of every solver's `options`


# ---- the clock every member checks: the runner sets a deadline around each member (`deadline`) and passes its
# share as `options.time_limit_s`; a heuristic keeps that limit (`keeps_limit`), and a member checks `out_of_time()`
# between its variants (helpers deep inside a heuristic take no options, so the deadline is not an argument);
# tests swap in a clock of their own (`using_clock`) to stop members without measuring wall time


@dataclass
class _Deadline:
    """When the innermost deadline falls, and when `out_of_time` was last asked under it (or it was set): the time
    between two checks is what the next unit of work is expected to take."""

    end: float
    checked: float


_CLOCK: ContextVar[Callable[[], float]] = ContextVar("xsched_clock", default=time.perf_counter)
# the default is never changed: out_of_time writes `checked` only under a deadline that `deadline` set
_DEADLINE: ContextVar[_Deadline] = ContextVar("xsched_deadline", default=_Deadline(math.inf, 0.0))  # noqa: B039


def now() -> float:
    """The solve stage's clock, in seconds (time.perf_counter unless a test set another)."""
    return _CLOCK.get()()


def time_left() -> float:
    """Seconds until the innermost deadline (inf without one)."""
    return _DEADLINE.get().end - now()


def past_deadline() -> bool:
    """The deadline has passed (nothing predicted: what the runner labels a stopped member by)."""
    return time_left() <= 0.0


def out_of_time() -> bool:
    """Start nothing new and return the best plan so far: the deadline has passed, or it is nearer than the time
    since the last check, so another unit of work as long as the last would end past it."""
    d, t = _DEADLINE.get(), now()
    if d.end == math.inf:
        return False
    since, d.checked = t - d.checked, t
    return d.end - t <= max(since, 0.0)


@contextmanager
def deadline(seconds: float | None) -> Iterator[float]:
    """Within the block the deadline is `seconds` from now, or the enclosing one where that comes first (None: the
    enclosing one). Yields the seconds granted."""
    t = now()
    end = _DEADLINE.get().end if seconds is None else min(_DEADLINE.get().end, t + max(seconds, 0.0))
    token = _DEADLINE.set(_Deadline(end, t))
    try:
        yield end - t
    finally:
        _DEADLINE.reset(token)


@contextmanager
def using_clock(clock: Callable[[], float]) -> Iterator[None]:
    """The solve stage reads `clock` within the block (a test's fake clock that advances as it is read)."""
    token = _CLOCK.set(clock)
    outer = _DEADLINE.set(_Deadline(math.inf, 0.0))  # a deadline on the old clock means nothing on the new one
    try:
        yield
    finally:
        _DEADLINE.reset(outer)
        _CLOCK.reset(token)


# ---- the units of work a run has timed: a member whose one unit cannot be stopped part-way (or is costly to start)
# asks how long the same kind of unit took earlier in the run before it starts one (park-search: the park greedy's
# runs, timed by park first). The runner opens the record for its run (`timed_units`); outside one nothing is kept
_UNITS: ContextVar[dict[str, float] | None] = ContextVar("xsched_units", default=None)


@contextmanager
def timed_units() -> Iterator[None]:
    """Within the block (one solve) `note_unit` keeps the longest unit of each kind of work timed."""
    token = _UNITS.set({})
    try:
        yield
    finally:
        _UNITS.reset(token)


def note_unit(kind: str, seconds: float) -> None:
    """One unit of `kind` took `seconds` (kept where it is the longest of its kind in this solve)."""
    units = _UNITS.get()
    if units is not None:
        units[kind] = max(units.get(kind, 0.0), seconds)


def unit_s(kind: str) -> float:
    """The longest unit of `kind` timed in this solve (0 where none was, or outside a solve)."""
    units = _UNITS.get()
    return units.get(kind, 0.0) if units is not None else 0.0


R = TypeVar("R")


def keeps_limit(fn: Callable[[Problem, SolverOptions, Plan | None], R]) -> Callable[..., R]:
    """A heuristic `(problem, options, warm)` run within its own `options.time_limit_s` (None: the enclosing
    deadline), which its variants check with `out_of_time()`; called alone or by the runner, it keeps the limit."""

    @functools.wraps(fn)
    def run(problem: Problem, options: SolverOptions = DEFAULTS, warm: Plan | None = None) -> R:
        with deadline(options.time_limit_s):
            return fn(problem, options, warm)

    return run
