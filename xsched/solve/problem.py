"""What every solver takes and gives: the `Problem` (graph, profile, parsed budgets, devices, homes), the typed
`SolveResult`, the `Solver` protocol and the registry entry shape (`SolverEntry`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from xsched.budgets import parse_budgets
from xsched.contracts.graph import Graph
from xsched.contracts.plan import Compute, Plan
from xsched.contracts.profile import Profile
from xsched.errors import BudgetError, PlanError, XschedError
from xsched.simulate import simulate
from xsched.solve.eager import eager_peak
from xsched.solve.options import SolverOptions

# what a backend can say about its run; "optimal"/"feasible"/"time_limit" come with a plan (time_limit: stopped
# with the gap open), "infeasible" is a proof (of its formulation), "no_incumbent" stopped before any plan,
# "failed" a heuristic that does not fit (reason in `message`)
STATUSES = ("optimal", "feasible", "time_limit", "heuristic", "infeasible", "no_incumbent", "failed")


@dataclass(frozen=True)
class Problem:
    """One planning problem: budgets in bytes per device (a device without one is unlimited), the devices in
    order (the first is the default home), and the home of every graph input."""

    graph: Graph
    profile: Profile
    budgets: Mapping[str, int]
    devices: tuple[str, ...]
    homes: Mapping[str, str]

    @classmethod
    def make(
        cls,
        graph: Graph,
        profile: Profile,
        budgets: Mapping[str, str | int],
        devices: Sequence[str] | None = None,
        homes: Mapping[str, str] | None = None,
    ) -> Problem:
        """Parse `budgets` ("4GiB", bytes, "50%" of the eager peak), default the devices (the budgets' keys, else
        the profile's) and the homes (the first device), and check that they name each other consistently."""
        profile.check_graph(graph.fingerprint)
        parsed = parse_budgets(budgets, lambda: eager_peak(graph))
        devs = tuple(devices) if devices is not None else tuple(parsed) or tuple(profile.devices)
        if not devs:
            raise XschedError("no devices: give budgets or devices, or a profile with devices", stage="solve")
        for d in parsed:
            if d not in devs:
                raise BudgetError(
                    f"budget given for {d}, which is not among the devices {list(devs)}", stage="solve", device=d
                )
        full_homes = {v: devs[0] for v in graph.inputs} | dict(homes or {})
        stray = [v for v in full_homes if v not in graph.value or v in graph.producer]
        if stray:
            raise PlanError("home given for a value that is not a graph input", stage="solve", value=stray[0])
        return cls(graph, profile, dict(parsed), devs, full_homes)

    def with_budgets(self, budgets: Mapping[str, int]) -> Problem:
        """The same problem under other budgets (bytes)."""
        return Problem(self.graph, self.profile, dict(budgets), self.devices, self.homes)

    @property
    def size(self) -> int:
        """Ops x devices: what the registry's size thresholds compare with."""
        return len(self.graph.ops) * len(self.devices)

    def args(self) -> tuple[Graph, Profile, Mapping[str, int], tuple[str, ...], Mapping[str, str]]:
        """(graph, profile, budgets, devices, homes): the plain arguments of the solver functions."""
        return self.graph, self.profile, self.budgets, self.devices, self.homes


@dataclass(frozen=True)
class Times:
    """Seconds spent building the model, solving it and extracting plans (0 where a step does not apply)."""

    build_s: float = 0.0
    solve_s: float = 0.0
    extract_s: float = 0.0

    @property
    def total_s(self) -> float:
        return self.build_s + self.solve_s + self.extract_s


@dataclass(frozen=True)
class SolveResult:
    """What one solver run gives. `plan` is the best plan found (not yet budget-checked by the simulator: the
    registry's `run` does that), or None; `objective`/`bound` in seconds (time + alpha x energy), `gap` relative
    to the objective; `order` the op ids in the order the plan first computes them; `message` why there is no
    plan (or what the proof says)."""

    method: str
    status: str
    plan: Plan | None = None
    objective: float | None = None
    bound: float | None = None
    gap: float | None = None
    times: Times = Times()
    order: tuple[str, ...] | None = None
    message: str = ""
    extra: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"unknown solver status {self.status!r}; one of {STATUSES}")

    @property
    def proven_infeasible(self) -> bool:
        return self.status == "infeasible"


# A solver: the problem, its options, and an optional warm start (a plan for the same graph and homes).
Solver = Callable[[Problem, SolverOptions, "Plan | None"], SolveResult]


@dataclass(frozen=True)
class SolverEntry:
    """One row of the registry. kind "exact" (a model with a bound: proofs of infeasibility count) or
    "heuristic"; max_size: ops x devices beyond which `auto` does not call it (None: any size)."""

    name: str
    fn: Solver
    kind: str = "exact"
    max_size: int | None = None
    doc: str = ""
    requires: str | None = None  # an optional package it needs ("ortools"): absent, the entry is unavailable

    def fits(self, problem: Problem) -> bool:
        return self.max_size is None or problem.size <= self.max_size

    def available(self) -> bool:
        import importlib.util

        return self.requires is None or importlib.util.find_spec(self.requires) is not None


def validated(graph: Graph, plan: Plan, profile: Profile, budgets: Mapping[str, int]) -> Plan:
    """The plan under `budgets`, replayed by the simulator (PlanError if invalid), with its predicted figures: the
    one path by which any solver's plan leaves the solve stage. A captured graph's plan whose forward outputs are
    not resident when backward starts is repaired (those computes moved before it) or refused (PlanError): `wrap`
    could not run it."""
    from xsched.solve.autograd_boundary import keep_forward_outputs, missing_at_boundary

    plan = replace(plan, budgets=dict(budgets))
    missing = missing_at_boundary(graph, plan)
    if missing:
        repaired = keep_forward_outputs(graph, plan)
        try:
            result = simulate(graph, repaired, profile) if repaired is not None else None
        except PlanError:
            result = None
        if result is None:
            raise PlanError(BOUNDARY_RULE, stage="solve", value=missing[0])
        extra = {**repaired.solver.extra, "boundary_repaired": missing}
        return replace(repaired, predicted=result.prediction(), solver=replace(repaired.solver, extra=extra))
    result = simulate(graph, plan, profile)
    return replace(plan, predicted=result.prediction())


def objective(plan: Plan, options: SolverOptions) -> float:
    """What the exact solvers minimise, from the simulator's figures: time + alpha x energy."""
    p = plan.predicted
    return (p.time_s or 0.0) + options.alpha_energy * (p.energy_j or 0.0)


BOUNDARY_RULE = "a forward output is not resident when backward starts, and computing it earlier breaks the budgets"


def runnable(graph: Graph, plan: Plan, profile: Profile, budgets: Mapping[str, int]) -> Plan:
    """A heuristic's or a search's plan as `validated` gives it; one that breaks the boundary rule raises a
    BudgetError naming the value (a plan `wrap` cannot run does not meet the budgets), any other PlanError is a bug
    and propagates."""
    try:
        return validated(graph, plan, profile, budgets)
    except PlanError as e:
        if e.detail != BOUNDARY_RULE:
            raise
        raise BudgetError(f"{plan.solver.method}: {BOUNDARY_RULE}", stage="solve", value=e.value) from e


def first_order(plan: Plan) -> tuple[str, ...]:
    """The op ids in the order the plan first computes them: the order it chose."""
    return tuple(dict.fromkeys(s.op for s in plan.steps if isinstance(s, Compute)))
