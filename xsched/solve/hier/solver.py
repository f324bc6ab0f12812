"""`solve_hier`: the hierarchy, each class of identical blocks solved once (bottom blocks by the flat solvers,
the others by the H-ILP over their children's options) in a process pool, level by level, then the H-ILP of the
whole graph under the real budgets, flattened into one plan, which CP-SAT's interval model refines in the time
left (in the plan's own order, the plan as its complete hint)."""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, replace
from multiprocessing import get_context

from xsched.contracts.graph import Graph
from xsched.contracts.plan import Plan
from xsched.contracts.profile import Profile
from xsched.contracts.result import HierStats, SolveResult, Times
from xsched.errors import NoIncumbent, XschedError
from xsched.solve.autograd_boundary import forward_outputs
from xsched.solve.hier.canon import Canon, canon
from xsched.solve.hier.hextract import direct_plan
from xsched.solve.hier.hierarchy import MAX_GROUP, MAX_LEAF, MAX_TOP, Block, build_hierarchy
from xsched.solve.hier.hilp import Unit, solve_hilp
from xsched.solve.hier.hindex import index
from xsched.solve.hier.leaf import DRIVEN_FRACTIONS, LeafTask, leaf_options
from xsched.solve.hier.menu import Option, fastest, leanest, translate
from xsched.solve.hier.park import with_stores
from xsched.solve.hier.region import Region, deferrable, late_grads, make_region, sub_profile
from xsched.solve.hier.upper import RegionTask, region_options
from xsched.solve.objective import better, objective
from xsched.solve.options import DEFAULTS, SolverOptions, out_of_time
from xsched.solve.problem import Problem, runnable
from xsched.solve.registry import from_plan

# the menu of a hierarchy of up to MANY_BLOCKS blocks: bottom blocks also get budget-driven plans
# (leaf.DRIVEN_FRACTIONS) and each block keeps 12 options per home device (HiREmate's N_o; 6 kept too few of those
# plans: GPT-2-style 50%, hier's own plan +14.61% with 6, +11.74% with 12, +14.88% before). Above it, checkpointing's
# keep sets and 6 options, as before: the larger menu made a 96-layer GPT's top H-ILP (219 blocks) take all of its
# 600 s for no faster plan (+19.67% against +19.63% in 59 s, modelled costs)
OPTIONS_PER_BLOCK, OPTIONS_MANY_BLOCKS, MANY_BLOCKS = 12, 6, 32
TOP_SHARE = 0.6  # of the time left after the blocks, for the top H-ILP when a refinement can follow it
REFINE_MIN_S = 1.0  # a refinement with less time than this is not started
REFINE_MAX_SIZE = 5000  # ops x devices: beyond this the interval model takes its time just to build and load


@dataclass(frozen=True)
class HierSettings:
    """Sizes of the hierarchy, options kept per block, seconds per bottom MILP and per block H-ILP (0 for the
    MILP: checkpointing only), and worker processes (None: the core count)."""

    max_leaf: int = MAX_LEAF
    max_group: int = MAX_GROUP
    max_top: int = MAX_TOP
    options: int | None = None  # None: OPTIONS_PER_BLOCK, or OPTIONS_MANY_BLOCKS above MANY_BLOCKS blocks
    driven: bool | None = None  # budget-driven plans in the bottom blocks' options (None: up to MANY_BLOCKS blocks)
    leaf_s: float | None = None
    region_s: float | None = None
    workers: int | None = None
    defer: bool = True  # recompute options for gradient ops (region.deferrable)
    refine: bool = True  # CP-SAT's interval model on the best plan's order in the time left (needs OR-Tools)

    def __post_init__(self) -> None:
        for name, low in (("max_leaf", 1), ("max_group", 2), ("max_top", 1), ("options", 1)):
            if getattr(self, name) is not None and getattr(self, name) < low:
                raise XschedError(
                    f"hier setting {name} must be at least {low}, got {getattr(self, name)}", stage="solve"
                )

    def menu(self, blocks: int) -> tuple[int, tuple[float, ...]]:
        """Options kept per block and home device, and the budget fractions of the bottom blocks' budget-driven
        plans, in a hierarchy of `blocks` blocks."""
        small = blocks <= MANY_BLOCKS
        options = self.options if self.options is not None else OPTIONS_PER_BLOCK if small else OPTIONS_MANY_BLOCKS
        driven = self.driven if self.driven is not None else small
        return options, DRIVEN_FRACTIONS if driven else ()

    def seconds(self, limit: float) -> tuple[float, float]:
        """Per bottom MILP and per block H-ILP: 2% and 5% of the time limit (within [0.5, 5] and [1, 30] s)."""
        leaf = self.leaf_s if self.leaf_s is not None else min(5.0, max(0.5, 0.02 * limit))
        region = self.region_s if self.region_s is not None else min(30.0, max(1.0, 0.05 * limit))
        return leaf, region


@dataclass
class BlockLog:
    """What solving the blocks did, counted as they are solved: classes of identical blocks, solves, and seconds on
    the bottom blocks and on the others (HierStats' fields of the same names)."""

    classes: int = 0
    solved: int = 0
    leaf_s: float = 0.0
    region_s: float = 0.0


def solve_hier(
    problem: Problem,
    options: SolverOptions = DEFAULTS,
    warm_start: Plan | None = None,
    settings: HierSettings | None = None,
) -> Plan:
    """The hierarchical plan (simulator-checked under the problem's budgets) found within `options.time_limit_s`."""
    t0 = time.perf_counter()
    graph, budgets, homes = problem.graph, problem.budgets, problem.homes
    profile = with_stores(problem.profile)  # what parks, for the blocks' park options and their pricing
    st = settings or HierSettings()
    workers = st.workers if st.workers is not None else options.hier_processes
    limit = options.time_limit_s if options.time_limit_s is not None else 3600.0
    leaf_s, region_s = st.seconds(limit)
    devices = tuple(problem.devices)
    hier = build_hierarchy(graph, st.max_leaf, st.max_group, st.max_top)
    blocks = hier.blocks
    top = blocks[-1]
    pos = {id(b): i for i, b in enumerate(blocks)}
    per_block, fractions = st.menu(len(blocks) - 1)
    stats = HierStats(
        levels=hier.levels,
        blocks=len(blocks) - 1,
        options_per_block=per_block,
        driven_fractions=len(fractions),
        partition_s=time.perf_counter() - t0,
    )
    solved = _Solved(graph, profile, devices, homes, deferrable(graph) if st.defer else {})
    with _pool(workers, len(blocks)) as run:
        levels = sorted({b.level for b in blocks[:-1]})
        for level in levels:
            if out_of_time():  # the runner's deadline for this member (its pool checks it between tasks too)
                raise NoIncumbent(f"hier: stopped at the time limit before level {level} of {len(levels)}")
            mine = [b for b in blocks[:-1] if b.level == level]
            for leaf_pass in (True, False):  # bottom blocks of this level first: parents may mix both
                group = [b for b in mine if b.leaf == leaf_pass]
                if not group:
                    continue
                if leaf_pass:
                    solved.leaves(group, pos, run, leaf_s, per_block, options.seed, fractions)
                else:
                    solved.internal(group, pos, run, region_s, per_block, options.seed, options.node_limit)
    log = solved.log
    stats = replace(
        stats,
        classes=log.classes,
        solved=log.solved,
        leaf_s=log.leaf_s,
        region_s=log.region_s,
        before_top_s=time.perf_counter() - t0,
    )
    units = tuple(Unit(c.f_ops, c.b_ops, tuple(solved.options[pos[id(c)]])) for c in top.children)
    left = max(1.0, limit - (time.perf_counter() - t0))
    refine = st.refine and options.hier_refine and _refinable(graph, devices)
    top_s = max(1.0, TOP_SHARE * left) if refine else left
    try:
        plan, how = _top(graph, profile, units, budgets, devices, homes, replace(options, time_limit_s=top_s))
    except NoIncumbent:
        if warm_start is None or not refine:
            raise
        plan, how = None, "none"  # the refinement starts from the caller's plan
    info = plan.solver if plan is not None else SolveResult("hier", "no_incumbent")
    status = "time_limit" if info.status == "time_limit" else "feasible"
    own = objective(plan, options.alpha_energy) if plan is not None else None
    stats = replace(stats, top=how, top_status=info.status, top_gap=info.gap, top_stats=info.stats, hier_objective=own)
    if refine:
        start, source = _faster(plan, warm_start, options)
        left = limit - (time.perf_counter() - t0)
        refined, what = _refined(graph, profile, budgets, devices, homes, options, start, left)
        stats = replace(stats, refine=what)
        if refined is not start:
            plan, stats = refined, replace(stats, refined_from=source)
        elif plan is None:  # the caller's plan, unchanged, is not hier's: the caller keeps it as its own
            raise NoIncumbent(f"hier: no plan from the H-ILP, and the refinement of the warm start: {what}")
    record = SolveResult(
        "hier",
        status,
        objective=objective(plan, options.alpha_energy),
        stats=stats,
        times=Times(solve_s=time.perf_counter() - t0),
    )
    return replace(plan, solver=record)


# the registry's entry: an H-ILP's infeasibility is not a proof for the whole problem
run = from_plan(solve_hier, proofs=False)


def _refinable(graph: Graph, devices: tuple[str, ...]) -> bool:
    from xsched.solve.intervals.cpsat import available

    return available() and len(graph.ops) * len(devices) <= REFINE_MAX_SIZE


def _faster(plan: Plan | None, warm: Plan | None, options: SolverOptions) -> tuple[Plan, str]:
    """The better (objective.better) of hier's plan and the caller's, and which it is."""
    if plan is None or (warm is not None and warm.predicted is not None and better(warm, plan, options.alpha_energy)):
        return warm, "warm start"
    return plan, "hier"


def _refined(
    graph: Graph,
    profile: Profile,
    budgets: Mapping[str, int],
    devices: tuple[str, ...],
    homes: Mapping[str, str],
    options: SolverOptions,
    start: Plan,
    seconds: float,
) -> tuple[Plan, str]:
    """CP-SAT's interval model for `start`'s order, from `start` (a complete hint: every step has its slot), within
    `seconds`: its plan if faster, else `start`; and what happened, for the log."""
    from xsched.solve.intervals.solver import solve_intervals
    from xsched.solve.order.order import first_compute_indices

    if seconds < REFINE_MIN_S:
        return start, "no time left"
    try:
        plan = solve_intervals(
            Problem(graph, profile, budgets, devices, homes),
            replace(options, time_limit_s=seconds),
            start,
            order=first_compute_indices(graph, start),
            seed=options.seed,
            workers=options.solver_threads or 0,
        )
        plan = runnable(graph, plan, profile, budgets)  # wrap's boundary rule, which the model does not hold
    except XschedError as e:  # a BudgetError for the boundary rule too; an invalid plan (a bug) propagates
        if e.stage != "solve":
            raise
        return start, f"no plan ({e.detail[:60]})"
    if better(plan, start, options.alpha_energy):
        return plan, f"{start.predicted.time_s:.6g} -> {plan.predicted.time_s:.6g} s ({plan.solver.status})"
    return start, f"not faster ({plan.solver.status})"


def _top(
    graph: Graph,
    profile: Profile,
    units: tuple[Unit, ...],
    budgets: Mapping[str, int],
    devices: tuple[str, ...],
    homes: Mapping[str, str],
    options: SolverOptions,
) -> tuple[Plan, str]:
    """The H-ILP of the whole graph; without a plan from it, the better of the no-solver plans (every block once,
    fastest or leanest options) that fits the budgets, said so; else the H-ILP's own error."""
    fwd = forward_outputs(graph)
    try:
        return solve_hilp(graph, profile, units, budgets, devices, homes, fwd, options), "hilp"
    except XschedError as e:
        err = e
    ix = index(graph, profile, units, {}, devices, homes, fwd)
    first = devices[0]
    for name, pick in (("fast", fastest), ("lean", leanest)):
        try:
            return direct_plan(ix, [pick(u.options, first) for u in units], budgets), f"{name} (H-ILP: {err.detail})"
        except XschedError:
            continue
    # not a proof that no plan exists: the blocks, their options and the stage order restrict the model
    raise NoIncumbent(f"hier: {err.detail} (for this decomposition and its options)")


class _Solved:
    """Each block's options, by its position in the hierarchy's walk; one solve per class of identical blocks."""

    def __init__(
        self,
        graph: Graph,
        profile: Profile,
        devices: tuple[str, ...],
        homes: Mapping[str, str],
        defer: Mapping[str, tuple[str, ...]],
    ) -> None:
        self.graph, self.profile, self.devices, self.homes = graph, profile, devices, homes
        self.defer = defer
        self.kept = frozenset(v for vs in defer.values() for v in vs)
        self.grads = late_grads(graph, defer)
        self.options: dict[int, list[Option]] = {}
        self.keys: dict[int, str] = {}
        self.log = BlockLog()

    def _region(self, b: Block) -> Region:
        name = f"{self.graph.name}[{b.f_ops[0] if b.f_ops else b.b_ops[0]}]"
        return make_region(self.graph, b.f_ops, b.b_ops, name, self.kept, self.grads)

    def _homes(self, region: Region) -> dict[str, str]:
        return {v: self.homes[v] for v in region.inputs if v in self.homes}

    def _classes(self, group: Sequence[Block], children: Callable[[Block], tuple[str, ...]]):
        members: dict[str, list[tuple[Block, Region, Canon]]] = {}
        for b in group:
            region = self._region(b)
            c = canon(region, self.profile, self.devices, self._homes(region), children(b))
            members.setdefault(c.key, []).append((b, region, c))
        self.log.classes += len(members)
        return members

    def _spread(self, members, results, pos: Mapping[int, int]) -> None:
        for (key, group), opts in zip(members.items(), results):
            rep = group[0][2]
            for b, _, c in group:
                ops, values = rep.to(c)
                i = pos[id(b)]
                self.keys[i] = key
                self.options[i] = (
                    opts if c is rep else [translate(o, ops, values, self.graph, self.profile) for o in opts]
                )

    def leaves(
        self,
        group: Sequence[Block],
        pos: Mapping[int, int],
        run,
        seconds: float,
        limit: int,
        seed: int,
        fractions: tuple[float, ...],
    ) -> None:
        t0 = time.perf_counter()
        members = self._classes(group, lambda b: ())
        tasks = [
            LeafTask(
                r,
                sub_profile(self.profile, r.graph),
                self.devices,
                self._homes(r),
                seconds,
                limit,
                seed,
                tuple(o for o in r.b_ops if o in self.defer),
                fractions,
            )
            for _, r, _ in (g[0] for g in members.values())
        ]
        results = run(leaf_options, tasks)
        self.log.solved += len(tasks)
        self._spread(members, results, pos)
        self.log.leaf_s += time.perf_counter() - t0

    def internal(
        self,
        group: Sequence[Block],
        pos: Mapping[int, int],
        run,
        seconds: float,
        limit: int,
        seed: int,
        node_limit: int | None = None,
    ) -> None:
        t0 = time.perf_counter()
        members = self._classes(group, lambda b: tuple(self.keys[pos[id(c)]] for c in b.children))
        tasks = []
        for b, r, _ in (g[0] for g in members.values()):
            units = tuple(Unit(c.f_ops, c.b_ops, tuple(self.options[pos[id(c)]])) for c in b.children)
            tasks.append(
                RegionTask(
                    r,
                    sub_profile(self.profile, r.graph),
                    units,
                    self.devices,
                    self._homes(r),
                    seconds,
                    limit,
                    seed,
                    tuple(o for o in r.b_ops if o in self.defer),
                    node_limit,
                )
            )
        results = run(region_options, tasks)
        self.log.solved += len(tasks)
        self._spread(members, results, pos)
        self.log.region_s += time.perf_counter() - t0


_logger = logging.getLogger(__name__)


def _start_method() -> str:
    """fork (workers start at once), unless this process has initialised CUDA: a forked child inherits a CUDA
    context it cannot use and dies at its first CUDA call, or when its garbage collector frees a CUDA tensor."""
    torch = sys.modules.get("torch")  # not imported: no CUDA context (planning from files needs no torch)
    return "forkserver" if torch is not None and torch.cuda.is_initialized() else "fork"


class _pool:
    """map() over tasks: in this process for one worker or one task, else in a pool of worker processes (results
    in task order, so the outcome does not depend on which worker finishes first). A pool whose worker died
    (killed, out of memory) is given up, and its tasks run in this process: slower, but nothing is lost."""

    def __init__(self, workers: int | None, n: int) -> None:
        self.workers = max(1, workers if workers is not None else (os.cpu_count() or 1))
        self.executor: ProcessPoolExecutor | None = None

    def __enter__(self) -> Callable[[Callable, list], list]:
        return self.map

    def map(self, fn: Callable, tasks: list) -> list:
        """The tasks a worker-count at a time, the deadline checked between (a worker process cannot see it)."""
        out: list = []
        for k in range(0, len(tasks), self.workers):
            if k and out_of_time():
                raise NoIncumbent(f"hier: stopped at the time limit after {k} of {len(tasks)} blocks of a level")
            out += self._map(fn, tasks[k : k + self.workers])
        return out

    def _map(self, fn: Callable, tasks: list) -> list:
        if self.workers == 1 or len(tasks) <= 1:
            return [fn(t) for t in tasks]
        if self.executor is None:
            self.executor = ProcessPoolExecutor(self.workers, mp_context=get_context(_start_method()))
        try:
            return list(self.executor.map(fn, tasks))
        except BrokenProcessPool as e:
            _logger.warning("hier: a worker process died (%s); solving the blocks in this process", e)
            self.workers = 1
            self.executor.shutdown(cancel_futures=True)
            self.executor = None
            return [fn(t) for t in tasks]

    def __exit__(self, *exc: object) -> None:
        if self.executor is not None:
            self.executor.shutdown(cancel_futures=True)
