"""The solver registry: method name -> `SolverEntry`. Every solver is a function `(Problem, SolverOptions, warm
start) -> Outcome`, registered once here (or by its own module) with the sizes it is worth running at and its share
of the time left when it runs among others. Adding a solver: one module, one `register(...)` line
(docs/ARCHITECTURE.md, "Adding a solver")."""

from __future__ import annotations

import importlib
import importlib.util
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from xsched.contracts.holds import held_steps, holds_pinned, releasable
from xsched.contracts.plan import Plan
from xsched.contracts.result import SolveResult, Times
from xsched.errors import BudgetError, NoIncumbent, PlanError, XschedError
from xsched.solve.heuristics.checkpoint import checkpoint_search
from xsched.solve.heuristics.eager import eager
from xsched.solve.heuristics.fastest import fastest
from xsched.solve.heuristics.gaps import gap_remat
from xsched.solve.heuristics.greedy import greedy_fill
from xsched.solve.heuristics.keep_recomputes import keep_recomputes_search
from xsched.solve.heuristics.offload import offload_search
from xsched.solve.heuristics.park import park_remat
from xsched.solve.heuristics.park_recomputes import park_recomputes_search
from xsched.solve.heuristics.sqrt import sqrt_checkpoint
from xsched.solve.options import SolverOptions, past_deadline, time_left
from xsched.solve.problem import Outcome, Problem

# A solver: the problem, its options (options.time_limit_s is its own share of the time), and a warm start (the
# best plan so far, for the same graph and homes, or None). It returns an Outcome: its record, with or without a plan.
Solver = Callable[[Problem, SolverOptions, "Plan | None"], Outcome]

KINDS = ("heuristic", "search", "exact")  # heuristics run first and whole; searches and exact models share time
# what loading a member's heavy modules takes, on the 2-core development machine under load (Pyomo with its HiGHS
# interface and xsched's model modules 1.4 s, OR-Tools' CP-SAT 0.6 s, torch 2.8-3.0 s at a load of 4.6; more under
# a heavier load): the runner budgets for an entry's `imports` with it, and fused-cut for torch where it needs it
IMPORT_S = {
    "pyomo.environ": 1.5,
    "ortools.sat.python.cp_model": 0.7,
    "torch": 3.0,
}


@dataclass(frozen=True)
class SolverEntry:
    """One method. `min_size`/`max_size`: ops x devices outside which a configuration (auto, portfolio) does not
    run it (a method named on its own always runs); `share`: its share of the time left when later members follow
    it; `one_device`: it plans for one computing device (the others may only store); `requires`: an optional
    package it needs; `imports`: the heavy modules its first call loads (the runner does not start it where the time
    left cannot cover loading them, IMPORT_S); `refines`: it improves the plan it is handed (a heuristic is handed
    the best so far) and a configuration runs it only once there is one."""

    name: str
    fn: Solver
    kind: str = "exact"
    min_size: int = 0
    max_size: int | None = None
    share: float = 1.0
    one_device: bool = False
    requires: str | None = None
    imports: tuple[str, ...] = ()
    doc: str = ""
    refines: bool = False  # it refines the best plan so far: in a configuration, run only once there is one

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
    """A solver from one that returns a Plan carrying its own record (`plan.solver`) or raises. With `proofs`
    (an exact model), its BudgetError proves that no plan of its formulation meets the budgets: status
    "infeasible"; otherwise it is a heuristic that does not fit: "failed". Stopping without a plan is
    "no_incumbent". An invalid plan (PlanError) is a bug of the backend and propagates."""

    def run(problem: Problem, options: SolverOptions, warm: Plan | None = None) -> Outcome:
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
            times = Times(solve_s=time.perf_counter() - t0)
            return Outcome(SolveResult("", status, message=e.detail, times=times, error=e))
        return Outcome(plan.solver, plan)

    return run


def lazy(target: str, *imports: str) -> Solver:
    """The solver `module:function`, imported on its first call with the packages of `imports` its run loads
    (Pyomo, OR-Tools and torch load only when used). A first import takes seconds that the clock cannot interrupt,
    so it runs beside the caller, which waits for it only while its time lasts (`import_within`)."""

    def run(problem: Problem, options: SolverOptions, warm: Plan | None = None) -> Outcome:
        module, _, name = target.partition(":")
        waited = time.perf_counter()
        for m in (module, *imports):
            if not import_within(m, time_left()):
                why = f"not started: importing {m} took the {time.perf_counter() - waited:.1f} s it had"
                return Outcome(SolveResult("", "no_incumbent", message=why))
        fn = getattr(importlib.import_module(module), name)
        if past_deadline():  # the first import (Pyomo: seconds) took the member's time
            return Outcome(SolveResult("", "no_incumbent", message=f"no time left after importing {module}"))
        return fn(problem, options, warm)

    return run


def lazy_entry(name: str, target: str, **fields) -> SolverEntry:
    """A registry entry whose solver `module:function` is imported on its first call (`lazy`) with the modules of
    its `imports` field: one list for what the runner budgets time for and what the call loads."""
    return SolverEntry(name, lazy(target, *fields.get("imports", ())), **fields)


_IMPORTS: dict[str, threading.Event] = {}  # module -> set once its import (in a thread of its own) has ended
_IMPORTS_LOCK = threading.Lock()


def import_within(module: str, seconds: float) -> bool:
    """`module` imported, or being imported in a background thread that ends within `seconds` (inf: however long);
    False if it has not ended by then (it goes on, and a later call finds it done). No two imports run at once,
    and a caller runs nothing while one is under way (a forked worker must not inherit an import's locks), so
    this first waits for any other import under way."""
    end = time.perf_counter() + max(seconds, 0.0)
    with _IMPORTS_LOCK:
        others = [e for m, e in _IMPORTS.items() if m != module and not e.is_set()]
    for event in others:
        if not event.wait(_timeout(end)):
            return False
    with _IMPORTS_LOCK:
        if module not in _IMPORTS:
            if module in sys.modules:  # imported by someone else
                return True
            _IMPORTS[module] = threading.Event()
            threading.Thread(target=_import, args=(module,), name=f"xsched import {module}", daemon=True).start()
        event = _IMPORTS[module]
    return event.wait(_timeout(end))


def _import(module: str) -> None:
    try:
        importlib.import_module(module)
    except BaseException:  # the caller's own import_module raises it again, in the caller's thread
        pass
    finally:
        _IMPORTS[module].set()


def _timeout(end: float) -> float | None:
    left = end - time.perf_counter()
    return None if left == float("inf") else max(left, 0.0)


def heuristic(name: str, fn: Callable[[Problem, SolverOptions, Plan | None], Plan]) -> SolverEntry:
    """A registry entry for a heuristic: a solver that returns its Plan or raises (a BudgetError: it does not fit)."""
    return SolverEntry(
        name, from_plan(fn, proofs=False), kind="heuristic", doc=(fn.__doc__ or "").strip().split("\n")[0]
    )


def run_member(entry: SolverEntry, problem: Problem, options: SolverOptions, warm: Plan | None) -> Outcome:
    """One run of a registered solver, its record labelled with the entry's name where the backend gave none. Where
    the caller holds outputs that a plan may release (`contracts.holds`), a heuristic first plans with them kept
    resident, and releases them only where that finds no plan (or the best plan so far releases them already):
    releasing one costs its refill at the end (GPT-2's logits: a 12 ms matmul on an H100), which the heuristics,
    freeing what they can, do not weigh. A member that refines or searches from a plan keeps that plan's choice
    (without one, it may release)."""
    if not releasable(problem.graph):
        return _labelled(entry, problem, options, warm)
    releases = warm is not None and bool(held_steps(problem.graph, warm))
    if entry.kind == "heuristic" and not entry.refines and not releases:
        with holds_pinned():
            r = _labelled(entry, problem, options, warm)
        return r if r.plan is not None else _labelled(entry, problem, options, warm)
    with holds_pinned(warm is not None and not releases):
        return _labelled(entry, problem, options, warm)


def _labelled(entry: SolverEntry, problem: Problem, options: SolverOptions, warm: Plan | None) -> Outcome:
    r = entry.fn(problem, options, warm)
    return r if r.method else Outcome(replace(r.record, method=entry.name), r.plan)


def _fused_cut(problem: Problem, options: SolverOptions, warm: Plan | None) -> Plan:
    """fused-cut, not started where it needs torch (the ops' pointwise tags) and the time left cannot cover its
    import, which is waited for only while that time lasts (`import_within`)."""
    from xsched.profiling.fused import needs_torch
    from xsched.solve.heuristics.fused_cut import run

    if needs_torch(problem.graph) and "torch" not in sys.modules:
        left = time_left()
        if left < IMPORT_S["torch"] or not import_within("torch", left):
            why = f"not started: importing torch (about {IMPORT_S['torch']:g} s) for the ops' pointwise tags"
            raise NoIncumbent(f"{why} takes more than the {max(left, 0.0):.2f} s left", stage="solve")
    return run(problem, options, warm)


CP_SAT = "ortools.sat.python.cp_model"  # OR-Tools' CP-SAT: a second's import, when it is installed

# ---- the built-in solvers, one line each (sizes are ops x devices); the heuristics run first, in this order: the
# constructions that end on their own first, then the two that search for as long as their share of the time lasts
# (so they get what the others leave, and a plan within --gap found first spares them)
register(heuristic("eager", eager))
register(heuristic("greedy", greedy_fill))
register(heuristic("fastest", fastest))
register(heuristic("sqrt", sqrt_checkpoint))
register(heuristic("gaps", gap_remat))
register(heuristic("park", park_remat))
register(heuristic("checkpoint", checkpoint_search))
# after checkpoint, whose plan (or park's) it refines, and before offload, which takes whatever time is left
register(replace(heuristic("park-recomputes", park_recomputes_search), refines=True))
register(replace(heuristic("keep-recomputes", keep_recomputes_search), refines=True))
register(heuristic("offload", offload_search))
register(
    lazy_entry(
        "hier",
        "xsched.solve.hier.solver:run",
        kind="search",
        min_size=100,
        share=0.4,
        imports=("pyomo.environ",),
        doc="hierarchical decomposition (HiREmate's H-Partition and H-ILP, on several devices)",
    )
)
# the stage MILP first where it is small: it proves optimality (in graph order) within seconds there
register(
    lazy_entry(
        "milp",
        "xsched.solve.milp.milp:run",
        max_size=60,
        share=0.5,
        imports=("pyomo.environ",),
        doc="the stage MILP (Checkmate's stages on several devices, copies overlapping compute in a stage), HiGHS",
    )
)
register(
    lazy_entry(
        "park-search",
        "xsched.solve.heuristics.park_search:park_search",
        kind="search",
        max_size=5000,
        share=0.3,
        doc="parking and recomputation, more variants than the park heuristic, within the time limit",
    )
)
register(
    lazy_entry(
        "order-gaps",
        "xsched.solve.order.gaps:run_gaps",
        kind="search",
        max_size=5000,
        share=0.25,
        one_device=True,
        doc="order search, each order scored by gap rematerialization",
    )
)
register(
    lazy_entry(
        "order-cpsat",
        "xsched.solve.order.cpsat:run_cpsat",
        kind="search",
        max_size=5000,
        share=0.35,
        requires="ortools",
        imports=(CP_SAT,),
        doc="order search, each order scored by CP-SAT on the interval model",
    )
)
register(
    lazy_entry(
        "intervals-cpsat",
        "xsched.solve.intervals.solver:run_cpsat",
        kind="search",
        max_size=5000,
        share=0.7,
        requires="ortools",
        imports=(CP_SAT,),
        doc="the retention-interval model for one order, CP-SAT",
    )
)
register(
    lazy_entry(
        "intervals-highs",
        "xsched.solve.intervals.solver:run_highs",
        kind="search",
        max_size=60,
        share=0.5,
        imports=("pyomo.environ", "xsched.solve.intervals.highs"),
        doc="the retention-interval model for one order, linearised, HiGHS",
    )
)
register(
    SolverEntry(
        "fused-cut",
        from_plan(lambda problem, options, warm: _fused_cut(problem, options, warm), proofs=False),
        kind="search",
        max_size=5000,
        share=0.05,
        one_device=True,
        doc="fusion-aware min-cut checkpointing: save at the cut, recompute fusible chains inside their consumers",
    )
)
