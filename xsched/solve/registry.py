"""The solver registry: method name -> `SolverEntry`. Every solver is a function `(Problem, SolverOptions, warm
start) -> SolveResult`, registered once here (or by its own module) with the sizes it is worth running at and its
share of the time left when it runs among others. Adding a solver: one module, one `register(...)` line
(docs/ARCHITECTURE.md, "Adding a solver")."""

from __future__ import annotations

import importlib
import importlib.util
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from xsched.contracts.plan import Plan
from xsched.contracts.result import SolveResult, Times
from xsched.errors import BudgetError, NoIncumbent, PlanError, XschedError
from xsched.solve.heuristics import HEURISTICS
from xsched.solve.options import SolverOptions, out_of_time
from xsched.solve.problem import Problem

# A solver: the problem, its options (options.time_limit_s is its own share of the time), and a warm start (the
# best plan so far, for the same graph and homes, or None). It returns a SolveResult with or without a plan.
Solver = Callable[[Problem, SolverOptions, "Plan | None"], SolveResult]

KINDS = ("heuristic", "search", "exact")  # heuristics run first and whole; searches and exact models share time


@dataclass(frozen=True)
class SolverEntry:
    """One method. `min_size`/`max_size`: ops x devices outside which a configuration (auto, portfolio) does not
    run it (a method named on its own always runs); `share`: its share of the time left when later members follow
    it; `one_device`: it plans for one computing device (the others may only store); `requires`: an optional
    package it needs."""

    name: str
    fn: Solver
    kind: str = "exact"
    min_size: int = 0
    max_size: int | None = None
    share: float = 1.0
    one_device: bool = False
    requires: str | None = None
    doc: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"solver kind {self.kind!r} is not one of {KINDS}")

    def available(self) -> bool:
        return self.requires is None or importlib.util.find_spec(self.requires) is not None

    def fits(self, problem: Problem) -> bool:
        """Worth running on this problem inside a configuration: its size in range, and one computing device (others
        only store) if it needs that."""
        size_ok = self.min_size <= problem.size and (self.max_size is None or problem.size <= self.max_size)
        return size_ok and (not self.one_device or len(problem.computing) == 1)


SOLVERS: dict[str, SolverEntry] = {}


def register(entry: SolverEntry) -> SolverEntry:
    """Add (or replace) a method; configurations pick it up by its kind, in registration order."""
    SOLVERS[entry.name] = entry
    return entry


def from_plan(call: Callable[[Problem, SolverOptions, Plan | None], Plan], *, proofs: bool) -> Solver:
    """A solver from a function that returns a Plan carrying its own record (`plan.solver`) or raises. With `proofs`
    (an exact model), its BudgetError proves that no plan of its formulation meets the budgets: status
    "infeasible"; otherwise it is a heuristic that does not fit: "failed". Stopping without a plan is
    "no_incumbent". An invalid plan (PlanError) is a bug of the backend and propagates."""

    def run(problem: Problem, options: SolverOptions, warm: Plan | None = None) -> SolveResult:
        t0 = time.perf_counter()
        try:
            plan = call(problem, options, warm)
        except PlanError:
            raise
        except XschedError as e:
            if e.stage not in ("solve", "budget"):
                raise
            if isinstance(e, NoIncumbent):
                status = "no_incumbent"
            elif isinstance(e, BudgetError):
                status = "infeasible" if proofs else "failed"
            else:
                status = "no_incumbent" if proofs else "failed"
            return SolveResult("", status, message=e.detail, times=Times(solve_s=time.perf_counter() - t0), error=e)
        return replace(plan.solver, plan=plan)

    return run


def lazy(target: str) -> Solver:
    """The solver `module:function`, imported on its first call (Pyomo, OR-Tools and torch load only when used)."""

    def run(problem: Problem, options: SolverOptions, warm: Plan | None = None) -> SolveResult:
        module, _, name = target.partition(":")
        fn = getattr(importlib.import_module(module), name)
        if out_of_time():  # the first import (Pyomo: seconds) took the member's time
            return SolveResult("", "no_incumbent", message=f"no time left after importing {module}")
        return fn(problem, options, warm)

    return run


def heuristic(name: str, fn: Callable[..., Plan]) -> SolverEntry:
    """A registry entry for a plain-argument heuristic `fn(graph, profile, budgets, devices, homes) -> Plan`."""
    call = from_plan(lambda problem, options, warm: fn(*problem.args()), proofs=False)
    return SolverEntry(name, call, kind="heuristic", doc=(fn.__doc__ or "").strip().split("\n")[0])


def run_member(entry: SolverEntry, problem: Problem, options: SolverOptions, warm: Plan | None) -> SolveResult:
    """One run of a registered solver, its result labelled with the entry's name where the backend gave none."""
    r = entry.fn(problem, options, warm)
    return r if r.method else replace(r, method=entry.name)


# ---- the built-in solvers, one line each (sizes are ops x devices)
for _name, _fn in HEURISTICS.items():
    register(heuristic(_name, _fn))
register(
    SolverEntry(
        "hier",
        lazy("xsched.solve.hier.solver:run"),
        kind="search",
        min_size=100,
        share=0.4,
        doc="hierarchical decomposition (HiREmate's H-Partition and H-ILP, on several devices)",
    )
)
# the stage MILP first where it is small: it proves optimality (in graph order) within seconds there
register(
    SolverEntry(
        "milp",
        lazy("xsched.solve.milp:run"),
        max_size=60,
        share=0.5,
        doc="the stage MILP (Checkmate's stages on several devices, copies overlapping compute in a stage), HiGHS",
    )
)
register(
    SolverEntry(
        "park-search",
        lazy("xsched.solve.park_remat:run_search"),
        kind="search",
        max_size=5000,
        share=0.3,
        doc="parking and recomputation, more variants than the park heuristic, within the time limit",
    )
)
register(
    SolverEntry(
        "order-gaps",
        lazy("xsched.solve.order_search:run_gaps"),
        kind="search",
        max_size=5000,
        share=0.25,
        one_device=True,
        doc="order search, each order scored by gap rematerialization",
    )
)
register(
    SolverEntry(
        "order-cpsat",
        lazy("xsched.solve.order_search:run_cpsat"),
        kind="search",
        max_size=5000,
        share=0.35,
        requires="ortools",
        doc="order search, each order scored by CP-SAT on the interval model",
    )
)
register(
    SolverEntry(
        "intervals-cpsat",
        lazy("xsched.solve.intervals:run_cpsat"),
        kind="search",
        max_size=5000,
        share=0.7,
        requires="ortools",
        doc="the retention-interval model for one order, CP-SAT",
    )
)
register(
    SolverEntry(
        "intervals-highs",
        lazy("xsched.solve.intervals:run_highs"),
        kind="search",
        max_size=60,
        share=0.5,
        doc="the retention-interval model for one order, linearised, HiGHS",
    )
)
