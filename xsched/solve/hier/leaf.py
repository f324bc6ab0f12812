"""Options of a bottom block: its sub-graph scheduled by the flat solvers, on each device — checkpointing with
every keep set (a fast spread of phantom sizes), gap rematerialization and eviction at a grid of budgets and the
stage MILP at two budgets, all between the leanest and the fastest checkpointing peaks — and, with several devices,
the MILP over all of them; each plan simulator-checked, then summarised."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

from xsched.contracts.plan import Compute, Plan, place_frees
from xsched.contracts.profile import Profile
from xsched.errors import BudgetError, XschedError
from xsched.solve.autograd_boundary import hold_to_boundary
from xsched.solve.heuristics.checkpoint import candidate_keeps, checkpoint_computes
from xsched.solve.heuristics.evict import evict_computes
from xsched.solve.heuristics.gaps import gap_computes
from xsched.solve.heuristics.routing import finish_with_early_homes, route
from xsched.solve.hier.menu import Option, pareto, partial, summarize
from xsched.solve.hier.park import park_plans
from xsched.solve.hier.region import Region, deferring_graph, plain, region_homes
from xsched.solve.objective import best_of
from xsched.solve.options import SolverOptions
from xsched.solve.problem import Problem, validated

# budgets of the budget-driven heuristics, between the leanest (0) and the fastest (1) checkpointing peak: dense at the
# lean end, where checkpointing's keep sets are sparse (GPT-2-style at 50%: hier's own plan +14.88% -> +11.74%)
DRIVEN_FRACTIONS = (0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
EXACT_FRACTIONS = (0.0, 0.5)  # MILP budgets between the leanest (0) and the fastest (1) heuristic peak
LEAF_GAP = 0.01  # an option within 1% of its block's optimum at that budget is as good as optimal one level up
MIXED_FRACTIONS = (0.5,)  # several devices: the MILP with one device's budget at these shares of its own peak


@dataclass(frozen=True)
class LeafTask:
    """What a worker needs to make a bottom block's options: the region, its profile, the devices, the homes
    of the graph inputs it reads, seconds per exact solve (0: heuristics only), options kept and the seed."""

    region: Region
    profile: Profile
    devices: tuple[str, ...]
    graph_homes: Mapping[str, str]
    exact_s: float
    limit: int
    seed: int = 0
    deferred: tuple[str, ...] = ()  # its deferrable gradient ops (region.deferrable)
    fractions: tuple[float, ...] = DRIVEN_FRACTIONS  # of its budget-driven plans (heuristic_plans); () for none


def leaf_options(task: LeafTask) -> list[Option]:
    """The block's options, the Pareto front of every plan found (at most `task.limit` per home device and set of
    outputs left), with a plan deferring its gradient ops derived from each."""
    region, prof = task.region, task.profile
    base = plain(region)  # plans are made without the late outputs, which only a deferring plan keeps
    sub = base.graph
    prof = replace(prof, graph=sub.fingerprint)
    made: list[tuple[Plan, str, str]] = []  # (plan, home, label)
    for h in task.devices:
        homes = region_homes(region, task.graph_homes, h)
        if not all(prof.can_run(o.id, h) for o in sub.ops):
            continue
        plans = heuristic_plans(base, prof, h, homes, task.fractions, task.devices)
        made += [(p, h, p.solver.method) for p in plans]
        if region.b_ops and plans:  # values kept for its backward part may wait on a store instead
            peaks = [p.predicted.peak_bytes.get(h, 0) for p in plans]
            made += [(p, h, label) for p, label in park_plans(sub, prof, h, homes, peaks, task.devices)]
        if task.exact_s > 0 and plans and region.b_ops:  # without a backward part every plan keeps the same
            peaks = sorted(p.predicted.peak_bytes.get(h, 0) for p in plans)
            for f in EXACT_FRACTIONS:
                budget = int(peaks[0] + f * (peaks[-1] - peaks[0]))
                plan = exact_plan(base, prof, {h: budget}, (h,), homes, task.exact_s, plans, task.seed)
                if plan is not None:
                    made.append((plan, h, f"milp@{f:g}"))
    found = [summarize(region, p, prof, h, label) for p, h, label in made]
    if len(task.devices) > 1 and task.exact_s > 0:
        mixed = _mixed(task, base, prof, found)
        made += mixed
        found += [summarize(region, p, prof, h, label) for p, h, label in mixed]
    if not made:
        raise BudgetError(  # not found, not a proof: the block may need several devices, or its budget search missed
            f"not found: no schedule of block {sub.name} on any of {list(task.devices)}",
            stage="solve",
            op=sub.ops[0].id if sub.ops else None,
        )
    found += deferring(region, made, prof, task.graph_homes, task.deferred)
    kept = pareto(found, task.limit, stores_of(prof, task.devices))
    if not region.b_ops:
        kept += cones(region, prof, task.devices, task.graph_homes, task.limit * 2)
    kept += deferred_options(region, prof, task.devices, task.graph_homes, task.deferred)
    return kept


def stores_of(prof: Profile, devices: Sequence[str]) -> frozenset[str]:
    """The stores among `devices` (declared in the profile: hier.park.with_stores)."""
    return frozenset(d for d in devices if d in prof.stores)


def deferring(
    region: Region,
    made: Sequence[tuple[Plan, str, str]],
    prof: Profile,
    graph_homes: Mapping[str, str],
    ops: Sequence[str],
) -> list[Option]:
    """Each plan with the gradients of the deferrable `ops` freed once made and the values their recomputes read
    left at the end (the level above makes the gradients again with `deferred_options`)."""
    if not ops:
        return []
    g = deferring_graph(region, ops)
    prof = replace(prof, graph=g.fingerprint)
    out = []
    for plan, h, label in made:
        homes = region_homes(region, graph_homes, h)
        steps = hold_to_boundary(g, place_frees(g, plan.steps, homes))
        try:
            out.append(
                summarize(
                    region,
                    finish_with_early_homes(g, steps, "defer", {}, homes, prof, time.perf_counter()),
                    prof,
                    h,
                    f"defer+{label}",
                )
            )
        except XschedError:
            continue
    return out


def deferred_options(
    region: Region, prof: Profile, devices: tuple[str, ...], graph_homes: Mapping[str, str], ops: Sequence[str]
) -> list[Option]:
    """Recompute options of a block's backward part: each deferrable gradient op alone, on each device, to make
    its parameter gradients again late (its first run's are then freed at once). It reads only boundary values:
    graph inputs and the values every region keeps for it (`make_region`'s `kept`)."""
    out = []
    for op in ops:
        for h in devices:
            if prof.can_run(op, h):
                steps = place_frees(region.graph, [Compute(op, h)], region_homes(region, graph_homes, h))
                out.append(partial(region, steps, prof, h, f"defer:{op}", backward=True))
    return out


def cones(
    region: Region, prof: Profile, devices: tuple[str, ...], graph_homes: Mapping[str, str], limit: int
) -> list[Option]:
    """Recompute options of a block without a backward part: for each output, the ops it depends on in the block
    (its cone) in graph order, on each device; the smallest `limit` cones. A wide DAG's long-lived values then cost
    a recompute of their own cone, not of the whole block."""
    sub = region.graph
    idx = sub.op_index
    seen: dict[frozenset[str], None] = {}
    for y in region.outputs:
        cone, stack = set(), [sub.producer[y]]
        while stack:
            o = stack.pop()
            if o not in cone:
                cone.add(o)
                stack += [sub.producer[v] for v in sub.op[o].inputs if v in sub.producer]
        if len(cone) < len(sub.ops):
            seen.setdefault(frozenset(cone))
    out = []
    for cone in sorted(seen, key=lambda c: (len(c), sorted(c)))[:limit]:
        for h in devices:
            if not all(prof.can_run(o, h) for o in cone):
                continue
            homes = region_homes(region, graph_homes, h)
            steps = place_frees(sub, [Compute(o, h) for o in sorted(cone, key=idx.__getitem__)], homes)
            out.append(partial(region, steps, prof, h, f"cone:{len(cone)}"))
    return out


def heuristic_plans(
    region: Region,
    prof: Profile,
    device: str,
    homes: Mapping[str, str],
    fractions: Sequence[float] = DRIVEN_FRACTIONS,
    via: Sequence[str] = (),
) -> list[Plan]:
    """Checkpointing on `device` with every keep set (graph order alone for a block without a backward part), then
    gap rematerialization and eviction at `fractions` of the way from the leanest to the fastest of those peaks.
    Routed as the heuristics are: through a chain of links over `via` where none is direct, copies home issued early
    where that is faster (routing.finish_with_early_homes)."""
    sub = region.graph
    keeps = candidate_keeps(sub) if region.b_ops else [set()]
    plans: list[Plan] = []
    seen: set[tuple[Compute, ...]] = set()

    def add(make: Callable[[], list[Compute]]) -> None:
        try:
            computes = make()
            if (key := tuple(computes)) in seen:
                return
            seen.add(key)
            steps = hold_to_boundary(sub, route(sub, computes, homes, prof, via=via))
        except BudgetError:  # over its budget, or a value no chain of links brings where it is read (not found)
            return
        plan = finish_with_early_homes(sub, steps, "checkpoint", {}, homes, prof, time.perf_counter())
        try:
            plans.append(validated(sub, plan, prof, {}))
        except XschedError:
            pass  # a forward output recomputed only after the boundary: not an option

    for keep in keeps:
        add(lambda keep=keep: checkpoint_computes(sub, keep, device))
    if region.b_ops and plans:
        peaks = sorted(p.predicted.peak_bytes.get(device, 0) for p in plans)
        order = range(len(sub.ops))
        for f in fractions:
            b = int(peaks[0] + f * (peaks[-1] - peaks[0]))
            add(lambda b=b: gap_computes(sub, order, device, b, prof))
            add(lambda b=b: evict_computes(sub, device, b, prof))
    return plans


def exact_plan(
    region: Region,
    prof: Profile,
    budgets: Mapping[str, int],
    devices: tuple[str, ...],
    homes: Mapping[str, str],
    seconds: float,
    starts: list[Plan],
    seed: int,
) -> Plan | None:
    """The stage MILP's plan within `budgets` (warm-started from the fastest plan of `starts` that fits), or None."""
    from xsched.solve.milp.milp import solve_milp

    sub = region.graph
    fits = [
        p
        for p in starts
        if all(p.predicted.peak_bytes.get(d, 0) <= b for d, b in budgets.items()) and dict(p.homes) == dict(homes)
    ]
    warm = best_of(fits)
    opts = SolverOptions(time_limit_s=seconds, solver_threads=1, seed=seed, restricted=(), mip_gap=LEAF_GAP)
    try:
        plan = solve_milp(Problem(sub, prof, budgets, devices, homes), opts, warm)
        plan = validated(sub, plan, prof, budgets)
    except XschedError:
        return None
    return replace(plan, budgets={})


def _mixed(task: LeafTask, base: Region, prof: Profile, single: list[Option]) -> list[tuple[Plan, str, str]]:
    """Several devices: the MILP over all of them with one device's budget at MIXED_FRACTIONS of the peak of its
    fastest single-device option's plan (inputs from other blocks on that device) and the others free."""
    out = []
    for d in task.devices:  # inputs from other blocks on the device whose memory is constrained
        homes = region_homes(base, task.graph_homes, d)
        mine = [o for o in single if o.home == d]
        if not mine:
            continue
        peak = min(mine, key=lambda o: o.time_s).peak.get(d, 0)
        for f in MIXED_FRACTIONS:
            plan = exact_plan(base, prof, {d: int(peak * f)}, task.devices, homes, task.exact_s, [], task.seed)
            if plan is not None:
                out.append((plan, d, f"milp-mixed:{d}@{f:g}"))
    return out
