"""What every solver takes, the `Problem` (graph, profile, parsed budgets, devices, homes), and gives, an `Outcome`
(its record and its plan); and the one path by which a plan leaves the solve stage (`validated`, `runnable`:
simulator-checked, autograd boundary rule kept)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from xsched.budgets import parse_budgets
from xsched.contracts.graph import Graph
from xsched.contracts.plan import Plan
from xsched.contracts.profile import Profile
from xsched.contracts.result import SolveResult
from xsched.errors import BudgetError, PlanError, XschedError
from xsched.simulate import simulate
from xsched.solve.reference import eager_peak


@dataclass(frozen=True)
class Problem:
    """One planning problem: budgets in bytes per device (a device without one is unlimited), the devices in
    order (the first is the default home), and the home of every graph input."""

    graph: Graph
    profile: Profile
    budgets: Mapping[str, int]
    devices: tuple[str, ...]
    homes: Mapping[str, str]

    def __post_init__(self) -> None:
        object.__setattr__(self, "devices", tuple(self.devices))  # a list given: hashable, and what solvers expect

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
    def computing(self) -> tuple[str, ...]:
        """The devices that run ops (a store device has no compute costs in the profile)."""
        return tuple(d for d in self.devices if self.profile.compute.get(d))

    @property
    def size(self) -> int:
        """Ops x devices: what the registry's size thresholds compare with."""
        return len(self.graph.ops) * len(self.devices)


@dataclass(frozen=True)
class Outcome:
    """What a solver gives: the record of its run and its plan (None without one). The plan carries the record as
    `plan.solver` (set here, so the two never disagree)."""

    record: SolveResult
    plan: Plan | None = None

    def __post_init__(self) -> None:
        if self.plan is not None and self.plan.solver is not self.record:
            object.__setattr__(self, "plan", replace(self.plan, solver=self.record))

    @property
    def method(self) -> str:
        return self.record.method

    @property
    def status(self) -> str:
        return self.record.status

    @property
    def objective(self) -> float | None:
        return self.record.objective

    @property
    def message(self) -> str:
        return self.record.message

    @property
    def error(self) -> XschedError | None:
        return self.record.error


def validated(graph: Graph, plan: Plan, profile: Profile, budgets: Mapping[str, int]) -> Plan:
    """The plan under `budgets`, replayed by the simulator (PlanError if invalid), with its predicted figures: the
    one path by which any solver's plan leaves the solve stage. A captured graph's plan whose forward outputs are
    not resident when backward starts is repaired (those computes moved before it) or refused (PlanError): `wrap`
    could not run it. Outputs the caller holds (`graph.held_outputs`) stay resident from the boundary to the end
    (`hold_to_end`); a plan that fits only by freeing them is refused (PlanError)."""
    from xsched.solve.autograd_boundary import hold_to_end, keep_forward_outputs, missing_at_boundary

    plan = replace(plan, budgets=dict(budgets))
    missing = missing_at_boundary(graph, plan)
    if missing:
        repaired = keep_forward_outputs(graph, plan)
        try:
            result = simulate(graph, hold_to_end(graph, repaired), profile) if repaired is not None else None
        except PlanError:
            result = None
        if result is None:
            raise PlanError(BOUNDARY_RULE, stage="solve", value=missing[0])
        assert repaired is not None
        solver = replace(repaired.solver, repaired=tuple(missing))
        return replace(hold_to_end(graph, repaired), predicted=result.prediction(), solver=solver)
    held = hold_to_end(graph, plan)
    try:
        result = simulate(graph, held, profile)
    except PlanError as e:
        if held is plan:
            raise
        raise PlanError(HELD_RULE, stage="solve", value=graph.held_outputs[0]) from e
    return replace(held, predicted=result.prediction())


BOUNDARY_RULE = "a forward output is not resident when backward starts, and computing it earlier breaks the budgets"
HELD_RULE = "the plan fits only by freeing a forward output that the caller holds through backward"


def runnable(graph: Graph, plan: Plan, profile: Profile, budgets: Mapping[str, int]) -> Plan:
    """A heuristic's or a search's plan as `validated` gives it; one that breaks the boundary rule raises a
    BudgetError naming the value (a plan `wrap` cannot run does not meet the budgets), any other PlanError is a bug
    and propagates."""
    try:
        return validated(graph, plan, profile, budgets)
    except PlanError as e:
        if e.detail not in (BOUNDARY_RULE, HELD_RULE):
            raise
        raise BudgetError(f"{plan.solver.method}: {e.detail}", stage="solve", value=e.value) from e
