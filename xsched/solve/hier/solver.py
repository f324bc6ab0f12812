"""`solve_hier`: the hierarchy, each class of identical blocks solved once (bottom blocks by the flat solvers,
the others by the H-ILP over their children's options) in a process pool, level by level, then the H-ILP of the
whole graph under the real budgets, flattened into one plan, which CP-SAT's interval model refines in the time
left (in the plan's own order, the plan as its complete hint)."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, replace

from xsched.contracts.graph import Graph
from xsched.contracts.plan import Plan
from xsched.contracts.profile import Profile
from xsched.contracts.result import HierStats, SolveResult, Times
from xsched.errors import BudgetError, NoIncumbent, XschedError
from xsched.solve.autograd_boundary import forward_outputs
from xsched.solve.bounds.memory import check_budgets
from xsched.solve.hier.blocks import BlockPool, SolvedBlocks
from xsched.solve.hier.hextract import direct_plan
from xsched.solve.hier.hierarchy import MAX_GROUP, MAX_LEAF, MAX_TOP, build_hierarchy
from xsched.solve.hier.hilp import Unit, solve_hilp
from xsched.solve.hier.hindex import index
from xsched.solve.hier.leaf import DRIVEN_FRACTIONS
from xsched.solve.hier.menu import fastest, leanest
from xsched.solve.hier.park import with_stores
from xsched.solve.hier.region import deferrable
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
    _budgets_can_be_met(problem)
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
    solved = SolvedBlocks(graph, profile, devices, homes, deferrable(graph) if st.defer else {})
    with BlockPool(workers, len(blocks)) as run:
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


def _budgets_can_be_met(problem: Problem) -> None:
    """check_budgets before any level is solved, its BudgetError saying *proven* (the runner checks before its
    members; hier alone must too: the simulator checks budgets at the steps that allocate, so a plan would pass
    inputs homed over a budget unseen, and a block's H-ILP would hold a constant memory row)."""
    try:
        check_budgets(problem.graph, problem.profile, problem.budgets, problem.devices, problem.homes)
    except BudgetError as e:
        raise BudgetError(f"hier: no plan, proven: {e.detail}", stage="solve", device=e.device, op=e.op) from e


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
