"""A solver run's record (the "solver" field of contract 3, docs/ARCHITECTURE.md): one frozen `SolveResult` with its
status, objective, bound, gap, times and typed per-backend stats; the plan carries it as `plan.solver`, and the
record holds no plan. JSON: `to_dict` / `result_from_dict`, stats tagged by their `kind`."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from xsched.errors import XschedError

# "optimal"/"feasible"/"time_limit"/"heuristic" come with a plan (time_limit: stopped with the gap open, heuristic:
# no bound worth a gap); "infeasible" is a proof (of the backend's formulation), "no_incumbent" stopped before any
# plan, "failed" a heuristic that does not fit (why in `message`)
STATUSES = ("optimal", "feasible", "time_limit", "heuristic", "infeasible", "no_incumbent", "failed")
WITH_PLAN = ("optimal", "feasible", "time_limit", "heuristic")


@dataclass(frozen=True)
class Times:
    """Seconds spent building the model, solving it and extracting plans (0 where a step does not apply)."""

    build_s: float = 0.0
    solve_s: float = 0.0
    extract_s: float = 0.0

    @property
    def total_s(self) -> float:
        return self.build_s + self.solve_s + self.extract_s


STATS_KINDS: dict[str, type[Stats]] = {}  # kind -> stats class, for reading plans back from JSON


def stats_kind(cls: type[Stats]) -> type[Stats]:
    """Register a stats class under its `kind` (a decorator): a new backend's stats read back from plan JSON."""
    STATS_KINDS[cls.kind] = cls
    return cls


@dataclass(frozen=True)
class Stats:
    """A backend's own figures. Subclasses are frozen dataclasses of plain fields (numbers, strings, tuples of
    them, nested Stats or results) and name themselves with `kind`."""

    kind: ClassVar[str] = "stats"

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, **{f.name: _encode(getattr(self, f.name)) for f in dataclasses.fields(self)}}


@stats_kind
@dataclass(frozen=True)
class HeuristicStats(Stats):
    """What a heuristic chose: its variant (keep set, eviction, ...), the order it ran, recomputes, and for
    offloading the values parked and how early they come back. None where it does not apply."""

    kind: ClassVar[str] = "heuristic"
    device: str | None = None  # the compute device of a one-device heuristic
    variant: str | None = None
    order: str | None = None  # the named starting order, or the index of a checkpointing order
    depth: int | None = None  # gap rematerialization: levels of inputs made again for one rerun
    kept: int | None = None  # checkpointing: values kept
    candidates: int | None = None  # checkpointing: candidates planned
    recomputes: int = 0
    parked: int = 0
    prefetch_ops: int | None = None
    deferred_frees: bool | None = None
    devices_used: tuple[str, ...] = ()


@stats_kind
@dataclass(frozen=True)
class MilpStats(Stats):
    """The stage MILP's run: its size, HiGHS's time, the incumbents, and its own objective and bound (in its
    formulation: first computes in graph order)."""

    kind: ClassVar[str] = "milp"
    model_objective: float | None = None
    model_bound: float | None = None
    n_binaries: int = 0
    n_constraints: int = 0
    handoff_s: float = 0.0
    incumbents: int = 0
    incumbent_s: tuple[float, ...] = ()  # when each incumbent came, from the call
    extracted: int = 0
    best_incumbent: int = -1
    warm_start: str | None = None
    warm_start_mapped: bool = False  # False: the start's first computes are not in graph order
    stopped_at_floor: bool = False  # an incumbent ran every op once at its fastest
    model_status: str | None = None  # the model's own ("optimal": proven in its formulation; the result may say less)


@stats_kind
@dataclass(frozen=True)
class IntervalStats(Stats):
    """The retention-interval model's run for one order: C, whether the plan kept the model's order, and the
    model's own objective and bound (for this order and C only; above one device the objective is an upper estimate
    of a plan's makespan, so neither bounds the plan's: solve/intervals/data.py)."""

    kind: ClassVar[str] = "intervals"
    backend: str = "cpsat"
    intervals: int = 2  # C: intervals per value and device
    order_kept: bool = True
    model_objective: float | None = None
    model_bound: float | None = None


@stats_kind
@dataclass(frozen=True)
class OrderSearchStats(Stats):
    """An order search: orders scored, where the best order came from, and its time."""

    kind: ClassVar[str] = "order-search"
    scorer: str = ""
    orders_tried: int = 0
    origin: str = ""
    search_s: float = 0.0


@stats_kind
@dataclass(frozen=True)
class HilpStats(Stats):
    """One H-ILP run (a block's or the top's): its stages, whether the greedy schedule started it, its size and its
    own objective and bound; `model_status` when the greedy schedule's plan was returned instead."""

    kind: ClassVar[str] = "hilp"
    stages: int = 0
    greedy_start: bool = False
    greedy_events: int = 0
    n_binaries: int = 0
    model_objective: float | None = None
    model_bound: float | None = None
    model_status: str | None = None


@stats_kind
@dataclass(frozen=True)
class HierStats(Stats):
    """The hierarchical solver's run: the hierarchy, the time on its blocks, how the top level was solved, and
    what the CP-SAT refinement did."""

    kind: ClassVar[str] = "hier"
    levels: int = 0
    blocks: int = 0
    options_per_block: int = 0
    driven_fractions: int = 0
    classes: int = 0
    solved: int = 0
    partition_s: float = 0.0
    leaf_s: float = 0.0
    region_s: float = 0.0
    before_top_s: float = 0.0
    top: str = ""  # how the top level was solved: "hilp", "greedy", "direct", "none"
    top_status: str = ""
    top_gap: float | None = None
    top_stats: Stats | None = None
    hier_objective: float | None = None  # the plan of the hierarchy, before any refinement
    refine: str | None = None  # what the refinement did (None: not run)
    refined_from: str | None = None  # "hier" or "warm start": the plan the refinement improved


@dataclass(frozen=True)
class MemberOutcome:
    """One member of a run: its status, seconds, the objective of its plan (None without one), and why not."""

    method: str
    status: str
    seconds: float
    objective: float | None = None
    message: str = ""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@stats_kind
@dataclass(frozen=True)
class RunStats(Stats):
    """The runner's record: each member's outcome in order, which found the plan (and its own result), the
    lower bound and what sets it, the warm start, and why a single method's own plan was not returned."""

    kind: ClassVar[str] = "run"
    members: tuple[MemberOutcome, ...] = ()
    found_by: str | None = None
    found: SolveResult | None = None  # the finding member's own record (its plan is this plan)
    bound_source: str = ""
    warm_start: str | None = None
    warm_start_objective: float | None = None
    fallback_reason: str | None = None  # a single method that found nothing better than its warm start


@dataclass(frozen=True)
class SolveResult:
    """The record of one solver run (the plan it found carries it as `plan.solver`; a solver returns both as an
    `Outcome`, xsched/solve/problem.py). `objective`: the plan's (solve/objective.py); `bound`: a lower bound on it
    (for the backend's formulation); `gap`: (objective - bound) / objective; `message`: why there is no plan or what
    a proof says; `error`: the exception behind a missing plan (not saved); `repaired`: forward outputs whose
    computes were moved before the autograd boundary to make the plan runnable."""

    method: str
    status: str
    objective: float | None = None
    bound: float | None = None
    gap: float | None = None
    times: Times = Times()
    stats: Stats | None = None
    message: str = ""
    error: XschedError | None = field(default=None, compare=False, repr=False)
    repaired: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"unknown solver status {self.status!r}; one of {STATUSES}")

    @property
    def solve_s(self) -> float:
        return self.times.total_s

    @property
    def found_by(self) -> str:
        """The member that found the plan: a run's finder, else this method."""
        return (self.stats.found_by if isinstance(self.stats, RunStats) else None) or self.method

    def to_dict(self) -> dict[str, Any]:
        """The JSON record (the error is not part of it)."""
        return {
            "method": self.method,
            "status": self.status,
            "objective": self.objective,
            "bound": self.bound,
            "gap": self.gap,
            "times": dataclasses.asdict(self.times),
            "stats": self.stats.to_dict() if self.stats is not None else None,
            "message": self.message,
            "repaired": list(self.repaired),
        }


def result_from_dict(d: Mapping[str, Any]) -> SolveResult:
    """A saved record back as a SolveResult (KeyError/TypeError/ValueError on a malformed one)."""
    times = d.get("times") or {}
    return SolveResult(
        method=str(d["method"]),
        status=str(d.get("status", "heuristic")),
        objective=_float(d.get("objective")),
        bound=_float(d.get("bound")),
        gap=_float(d.get("gap")),
        times=Times(*(float(times.get(k, 0.0)) for k in ("build_s", "solve_s", "extract_s"))),
        stats=_stats_from_dict(d.get("stats")),
        message=str(d.get("message", "")),
        repaired=tuple(d.get("repaired", ())),
    )


def _stats_from_dict(d: Mapping[str, Any] | None) -> Stats | None:
    if d is None:
        return None
    cls = STATS_KINDS.get(d.get("kind", ""))
    if cls is None:
        return None  # a backend not installed here: its figures are not read back
    kw = {}
    for f in dataclasses.fields(cls):
        if f.name in d:
            kw[f.name] = _decode(f.name, d[f.name])
    return cls(**kw)


def _decode(name: str, x: Any) -> Any:
    if name == "members":
        return tuple(MemberOutcome(**m) for m in x)
    if name == "found":
        return result_from_dict(x) if x is not None else None
    if isinstance(x, Mapping) and "kind" in x:
        return _stats_from_dict(x)
    if isinstance(x, list):
        return tuple(x)
    return x


def _encode(x: Any) -> Any:
    if isinstance(x, (Stats, SolveResult, MemberOutcome)):
        return x.to_dict()
    if isinstance(x, tuple):
        return [_encode(y) for y in x]
    return x


def _float(x: Any) -> float | None:
    return None if x is None else float(x)
