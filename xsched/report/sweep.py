"""Budget sweeps: the solver's plan, and the eager, greedy (accelerate-style) and checkpoint baselines, at many
budgets of one device (or of every accelerator at once), each plan checked by the simulator."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from xsched.contracts.graph import Graph
from xsched.contracts.plan import Plan
from xsched.contracts.profile import Profile
from xsched.errors import BudgetError, XschedError
from xsched.explain import Range, expected_reserved
from xsched.report.machines import Machine
from xsched.solve.api import solve
from xsched.solve.bounds.memory import lower_bounds
from xsched.solve.options import SolverOptions

BASELINES = ("eager", "greedy", "checkpoint")  # registered heuristics (xsched.solve.registry SOLVERS)


@dataclass(frozen=True)
class SweepSettings:
    """How sweeps solve: `method` at each point within `time_limit_s` (auto by default; a heuristic is cheaper),
    `points` budgets from the swept devices' lower bound to `high` x the eager peak, and the baselines beside it."""

    method: str = "auto"
    time_limit_s: float = 2.0
    points: int = 8
    baselines: tuple[str, ...] = BASELINES
    high: float = 1.25

    def options(self, **changes: float | None) -> SolverOptions:
        return replace(SolverOptions(time_limit_s=self.time_limit_s), **changes)

    @property
    def methods(self) -> tuple[str, ...]:
        return (self.method, *(b for b in self.baselines if b != self.method))


class PlanTimes:
    """What a report point shows of its plan's time: `time_s` (sequential) and `makespan_s`, None without a plan."""

    time_s: float | None
    makespan_s: float | None

    @property
    def ok(self) -> bool:
        return self.time_s is not None

    @property
    def step_s(self) -> float | None:
        """The time shown for the plan: its makespan (the overlapped run, what the executor does); the sequential
        sum only where there is no makespan."""
        return self.makespan_s if self.makespan_s is not None else self.time_s


@dataclass(frozen=True)
class Point(PlanTimes):
    """One plan (or the reason there is none) for one machine at one budget. Times in seconds, energy in joules,
    bytes per device; `status` is the solver's (optimal, time_limit, heuristic, ...) or "infeasible" (proven) or
    "no plan" (none found; `note` says why)."""

    machine: str
    swept: str
    budget_bytes: int
    method: str
    status: str
    time_s: float | None = None
    makespan_s: float | None = None
    energy_j: float | None = None
    peak_bytes: Mapping[str, int] = field(default_factory=dict)
    budgets: Mapping[str, int] = field(default_factory=dict)
    found_by: str | None = None
    solve_s: float = 0.0
    note: str = ""
    # per accelerator, modelled (xsched.explain.expected_reserved): the GPU keeping up with the host, the host a step
    # ahead, with the allocator's default settings, with expandable segments, and with planned addresses (whole steps)
    reserved_bytes: Mapping[str, tuple[int, int]] = field(default_factory=dict)
    expandable_bytes: Mapping[str, tuple[int, int]] = field(default_factory=dict)
    planned_bytes: Mapping[str, tuple[int, int]] = field(default_factory=dict)
    arena_bytes: Mapping[str, int] = field(default_factory=dict)  # the planned addresses' arena


@dataclass(frozen=True)
class Sweep:
    """The points of one sweep, with the swept devices' proven lower bound and the eager peak (bytes)."""

    machine: str
    swept: tuple[str, ...]
    lower_bound: int
    eager_peak: int
    points: tuple[Point, ...]
    plans: Mapping[int, Plan] = field(default_factory=dict, compare=False)  # budget -> the solver's plan

    @property
    def label(self) -> str:
        return " and ".join(self.swept)


def plan_point(
    graph: Graph,
    profile: Profile,
    machine: Machine,
    budgets: Mapping[str, int],
    method: str,
    options: SolverOptions,
) -> tuple[Plan | None, str, str]:
    """(plan, status, note): the method's plan within `budgets`, or None with "infeasible" (proven) or "no plan"
    and the solver's reason."""
    try:
        plan = solve(graph, profile, budgets, machine.devices, method, options)
    except BudgetError as e:
        # auto says "proven"; the bound check that every method runs first says "below the lower bound"
        proven = any(k in e.detail for k in ("proven", "below the lower bound", "no device can run op"))
        return None, "infeasible" if proven else "no plan", e.detail
    except XschedError as e:
        if e.stage != "solve":
            raise
        return None, "no plan", e.detail
    return plan, plan.solver.status, ""


def point_of(
    machine: Machine,
    swept: str,
    budget: int,
    method: str,
    budgets: Mapping[str, int],
    result: tuple[Plan | None, str, str],
    graph: Graph,
    profile: Profile,
) -> Point:
    """The point of one solve; with a plan, its predictions and what the caching allocator is expected to reserve
    for it on each accelerator (what runs out on a GPU)."""
    plan, status, note = result
    if plan is None:
        return Point(machine.label, swept, budget, method, status, budgets=dict(budgets), note=note)
    p = plan.predicted
    found = found_by(plan, method)
    return Point(
        machine.label,
        swept,
        budget,
        method,
        status,
        p.time_s,
        p.makespan_s,
        p.energy_j,
        dict(p.peak_bytes),
        dict(budgets),
        found,
        plan.solver.solve_s,
        **reserved_fields(graph, plan, profile),
    )


def reserved_fields(graph: Graph, plan: Plan, profile: Profile) -> dict[str, dict]:
    """A Point's reserved-memory fields: per accelerator, each setting's (GPU keeping up, host ahead) reserved bytes,
    and the planned addresses' arena."""
    expected = expected_reserved(graph, plan, profile)
    return {
        "reserved_bytes": {d: _ends(e.default) for d, e in expected.items()},
        "expandable_bytes": {d: _ends(e.expandable) for d, e in expected.items()},
        "planned_bytes": {d: _ends(e.planned) for d, e in expected.items()},
        "arena_bytes": {d: e.arena_bytes for d, e in expected.items()},
    }


def _ends(r: Range) -> tuple[int, int]:
    """Reserved bytes with the GPU keeping up and with the host a step ahead."""
    return r[0].reserved, r[1].reserved


def found_by(plan: Plan, method: str) -> str | None:
    """Which member found the plan when that is not `method` itself (auto's members, an exact solver's fallback)."""
    found = plan.solver.found_by
    return None if found == method else found


def budget_points(low: int, high: int, n: int, also: Sequence[int] = ()) -> list[int]:
    """`n` budgets evenly from `low` to `high` (bytes), plus `also` (e.g. the eager peak) within that range."""
    n = max(n, 2)
    pts = {int(round(low + (high - low) * k / (n - 1))) for k in range(n)}
    pts.update(b for b in also if low <= b <= high)
    return sorted(pts)


def sweep(
    graph: Graph,
    profile: Profile,
    machine: Machine,
    swept: Sequence[str],
    base: Mapping[str, int],
    eager_peak: int,
    settings: SweepSettings,
    tick: Callable[[], None] = lambda: None,
) -> Sweep:
    """Time (and energy, peaks) against the budget of the `swept` devices, all set to each budget together while
    the others keep their `base` budgets: the settings' method and each baseline at every point."""
    homes = {v: machine.devices[0] for v in graph.inputs}
    bounds = lower_bounds(graph, profile, machine.devices, homes)
    low = max(bounds[d].bytes for d in swept)
    high = max(int(eager_peak * settings.high), low + 1)
    label = "+".join(swept)
    points, plans = [], {}
    options = settings.options()
    for budget in budget_points(low, high, settings.points, (eager_peak,)):
        budgets = {**base, **dict.fromkeys(swept, budget)}
        for method in settings.methods:
            result = plan_point(graph, profile, machine, budgets, method, options)
            points.append(point_of(machine, label, budget, method, budgets, result, graph, profile))
            if method == settings.method and result[0] is not None:
                plans[budget] = result[0]
            tick()
    return Sweep(machine.label, tuple(swept), low, eager_peak, tuple(points), plans)


def count(settings: SweepSettings) -> int:
    """Solves one sweep makes at most (for progress bars)."""
    return (settings.points + 1) * len(settings.methods)
