"""Options of every solver (which Pyomo solver, its limits, the objective's energy terms, the HiGHS search knobs), and
the clock and deadline every member checks."""

from __future__ import annotations

import functools
import math
import statistics
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


def late_after(start: float, seconds: float) -> Callable[[], bool]:
    """A build's lateness: the innermost deadline is out of time (`out_of_time`), or `seconds` have passed since
    `start` on the solve stage's clock (its own limit)."""
    return lambda: out_of_time() or now() - start > seconds


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


# ---- good enough: the objective at or below which no plan need be sought (the run's lower bound on every plan
# widened by the gap asked, `--gap`); a member with variants left (park) stops once its best is there, as the runner
# skips members once a plan is within the gap
_ENOUGH: ContextVar[float] = ContextVar("xsched_enough", default=-math.inf)


def good_enough(value: float) -> bool:
    """A plan of this objective needs no better one: it is within the run's gap of the lower bound."""
    return value <= _ENOUGH.get()


@contextmanager
def enough_at(value: float) -> Iterator[None]:
    """Within the block a plan of objective `value` or less is good enough (`good_enough`)."""
    token = _ENOUGH.set(value)
    try:
        yield
    finally:
        _ENOUGH.reset(token)


@contextmanager
def using_clock(clock: Callable[[], float]) -> Iterator[None]:
    """The solve stage reads `clock` within the block (a test's fake clock that advances as it is read)."""
    token = _CLOCK.set(clock)
    outer = _DEADLINE.set(_Deadline(math.inf, 0.0))  # a deadline on the old clock means nothing on the new one
    run = _RUN.set(None)  # nor does a run's end
    try:
        yield
    finally:
        _RUN.reset(run)
        _DEADLINE.reset(outer)
        _CLOCK.reset(token)


# ---- one run of the runner: when its limit falls and the units of work timed in it. A unit that takes seconds
# and gives nothing if cut short (park-search's first run of the park greedy) may take its member past its own share
# of the time, never past the run's limit: the member asks how long the same kind of unit takes in this run (`unit_s`:
# the median of park's runs, timed by park first) and how long the run has left (`run_left`) before it starts one.
# The median, not the longest: a unit started and then stopped at the run's limit wastes time but keeps the limit,
# while one not started loses its plan (park's first run on a graph is its slowest: 0.54 s against 0.21 s for the
# same variant in park-search, GPT-2 6 layers)


@dataclass
class _Run:
    """When the run's limit falls, and the seconds of each kind of unit of work timed in it."""

    end: float
    units: dict[str, list[float]]


_RUN: ContextVar[_Run | None] = ContextVar("xsched_run", default=None)


@contextmanager
def one_run(seconds: float) -> Iterator[None]:
    """Within the block: one run of the runner, whose limit falls `seconds` from now."""
    token = _RUN.set(_Run(now() + seconds, {}))
    try:
        yield
    finally:
        _RUN.reset(token)


def run_left() -> float:
    """Seconds until the run's limit; outside a run, until the innermost deadline."""
    run = _RUN.get()
    return run.end - now() if run is not None else time_left()


def past_run_end() -> bool:
    """The run's limit has passed (outside a run: the innermost deadline)."""
    return run_left() <= 0.0


def note_unit(kind: str, seconds: float) -> None:
    """One unit of `kind` took `seconds` in this run (nothing is kept outside a run)."""
    run = _RUN.get()
    if run is not None:
        run.units.setdefault(kind, []).append(seconds)


def unit_s(kind: str) -> float:
    """What a unit of `kind` takes in this run: the median of those timed (0 where none was, or outside a run)."""
    run = _RUN.get()
    timed = run.units.get(kind) if run is not None else None
    return statistics.median(timed) if timed else 0.0


R = TypeVar("R")


def keeps_limit(fn: Callable[[Problem, SolverOptions, Plan | None], R]) -> Callable[..., R]:
    """A heuristic `(problem, options, warm)` run within its own `options.time_limit_s` (None: the enclosing
    deadline), which its variants check with `out_of_time()`; called alone or by the runner, it keeps the limit."""

    @functools.wraps(fn)
    def run(problem: Problem, options: SolverOptions = DEFAULTS, warm: Plan | None = None) -> R:
        with deadline(options.time_limit_s):
            return fn(problem, options, warm)

    return run
