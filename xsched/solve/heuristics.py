"""Baseline plans and MILP warm starts: single-device eager, greedy fill, fastest device, checkpointing.

Every function returns a `Plan` that `simulate` accepted under its budgets, or raises `BudgetError`
naming the device and the op where the heuristic ran out of memory.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import replace

from xsched.budgets import format_bytes
from xsched.errors import BudgetError, PlanError, XschedError
from xsched.graph import Graph
from xsched.plan import Compute, Copy, Plan, SolverInfo, Step, autograd_boundary, place_frees, required_homes
from xsched.profile import Profile
from xsched.simulate import simulate

# ---------------------------------------------------------------- routing: computes -> steps with copies and frees


def route(
    graph: Graph,
    computes: Iterable[Compute],
    homes: Mapping[str, str],
    profile: Profile | None = None,
    *,
    early_home_copies: bool = False,
) -> tuple[Step, ...]:
    """Steps running `computes` in order, with the copies their inputs need and frees after last uses.

    An input not resident on the op's device is copied there right before the op, from the resident
    device with the cheapest link. Outputs that must end on a param's or buffer's home are copied
    there at the end (or right after they are produced with `early_home_copies`, which frees the
    producing device sooner at the price of holding them longer at home).
    """
    where: dict[str, list[str]] = {v: [d] for v, d in homes.items()}
    must_end_on = required_homes(graph, homes)
    steps: list[Step] = []

    def copy_to(v: str, dst: str, op: str | None) -> None:
        if v not in where:
            raise PlanError("value is read before any step produces it", stage="solve", op=op, value=v, device=dst)
        steps.append(Copy(v, _cheapest_source(v, where[v], dst, graph, profile, op), dst))
        where[v].append(dst)

    for c in computes:
        op = graph.op[c.op]
        for v in dict.fromkeys(op.inputs):
            if c.device not in where.get(v, ()):
                copy_to(v, c.device, op.id)
        steps.append(c)
        for v in op.outputs:
            on = where.setdefault(v, [])
            if c.device not in on:
                on.append(c.device)
            if early_home_copies and must_end_on.get(v, c.device) not in on:
                copy_to(v, must_end_on[v], op.id)
    for v, home in must_end_on.items():
        if home not in where.get(v, ()):
            copy_to(v, home, graph.producer.get(v))
    return place_frees(graph, steps, homes)


def _cheapest_source(
    v: str, held: Sequence[str], dst: str, graph: Graph, profile: Profile | None, op: str | None
) -> str:
    if profile is None:
        return held[0]
    times = [(t, d) for d in held if (t := profile.copy_time(v, graph.value[v].nbytes, d, dst)) is not None]
    if not times:
        raise PlanError(
            f"no copy link from {', '.join(held)} to {dst} in the profile", stage="solve", op=op, value=v, device=dst
        )
    return min(times)[1]


def insert_copies(
    graph: Graph, assignment: Mapping[str, str], homes: Mapping[str, str], profile: Profile | None = None
) -> tuple[Step, ...]:
    """Every op once, in graph order, on its assigned device, with the copies and frees that needs."""
    missing = [o.id for o in graph.ops if o.id not in assignment]
    if missing:
        raise PlanError(f"{len(missing)} ops have no device in the assignment", stage="solve", op=missing[0])
    return route(graph, (Compute(o.id, assignment[o.id]) for o in graph.ops), homes, profile)


def finish(
    graph: Graph,
    steps: Sequence[Step],
    name: str,
    budgets: Mapping[str, int],
    homes: Mapping[str, str],
    profile: Profile | None,
    started: float,
    **extra: object,
) -> Plan:
    """Wrap steps in a Plan, check it with the simulator and attach its predicted figures.

    Over a budget is a BudgetError naming the device, its peak and the step where the peak is reached.
    """
    plan = Plan(
        graph=graph.fingerprint,
        budgets=dict(budgets),
        homes=dict(homes),
        steps=tuple(steps),
        solver=SolverInfo(method=f"heuristic:{name}", status="heuristic", extra=extra),
        boundary=autograd_boundary(graph, steps),
    )
    result = simulate(graph, plan, profile, check_budgets=False)
    for d, budget in budgets.items():
        peak = result.peak_bytes.get(d, 0)
        if peak > budget:
            i = result.peak_step[d]
            s = plan.steps[i] if i >= 0 else None
            op = s.op if isinstance(s, Compute) else graph.producer.get(s.value) if isinstance(s, Copy) else None
            what = f"compute of {op}" if isinstance(s, Compute) else f"copy of {s.value}" if s else "the homed inputs"
            raise BudgetError(
                f"{name} plan peaks at {format_bytes(peak)} on {d} (budget {format_bytes(budget)}) at step {i}, {what}",
                stage="solve",
                device=d,
                op=op,
            )
    solver = replace(plan.solver, solve_s=time.perf_counter() - started)
    return replace(plan, solver=solver, predicted=result.prediction())


def _route_and_finish(graph, computes, name, budgets, homes, profile, started, **extra) -> Plan:  # noqa: ANN001
    """finish(route(...)); when that is over budget, retry with home copies right after production."""
    computes = list(computes)
    try:
        return finish(graph, route(graph, computes, homes, profile), name, budgets, homes, profile, started, **extra)
    except BudgetError:
        if not required_homes(graph, homes):
            raise
        early = route(graph, computes, homes, profile, early_home_copies=True)
        return finish(graph, early, name, budgets, homes, profile, started, **extra)


def best_single_device(
    build: Callable[[str], Plan], graph: Graph, profile: Profile | None, devices: Sequence[str], name: str
) -> Plan:
    """The fastest plan `build(device)` over the devices that can run every op; BudgetError if none fits."""
    plans: list[Plan] = []
    failures: list[str] = []
    for d in devices:
        if profile is not None and not all(profile.can_run(o.id, d) for o in graph.ops):
            failures.append(f"{d}: cannot run every op")
            continue
        try:
            plans.append(build(d))
        except BudgetError as e:
            failures.append(f"{d}: {e.detail}")
    if not plans:
        raise BudgetError(
            f"no single device can hold the {name} plan: " + "; ".join(failures),
            stage="solve",
            device=devices[0] if devices else None,
        )
    return min(plans, key=lambda p: p.predicted.time_s or 0.0)


# ---------------------------------------------------------------- baselines


def eager(
    graph: Graph, profile: Profile | None, budgets: Mapping[str, int], devices: Sequence[str], homes: Mapping[str, str]
) -> Plan:
    """The eager schedule on each single device (inputs copied in from their homes); the fastest that fits."""

    def on(d: str) -> Plan:
        t0 = time.perf_counter()
        return _route_and_finish(
            graph, (Compute(o.id, d) for o in graph.ops), "eager", budgets, homes, profile, t0, device=d
        )

    return best_single_device(on, graph, profile, devices, "eager")


def greedy_fill(
    graph: Graph, profile: Profile | None, budgets: Mapping[str, int], devices: Sequence[str], homes: Mapping[str, str]
) -> Plan:
    """accelerate's infer_auto_device_map on ops: fill the devices in order, moving on when one is full.

    Memory is tracked conservatively while filling (a value stays on every device that holds it until
    its last consumer anywhere), so the final plan, whose frees come after last uses per device,
    never needs more than the tracker saw.
    """
    t0 = time.perf_counter()
    nbytes = {v.id: v.nbytes for v in graph.values}
    last_use = {v: graph.op_index[c[-1]] for v, c in graph.consumers.items() if c}
    keep = set(graph.outputs)
    held: dict[str, set[str]] = {d: set() for d in devices}
    used = dict.fromkeys(devices, 0)
    for v, d in homes.items():
        held.setdefault(d, set()).add(v)
        used[d] = used.get(d, 0) + nbytes[v]
    full: set[str] = set()
    assignment: dict[str, str] = {}
    for i, op in enumerate(graph.ops):
        ins = set(op.inputs)
        for d in devices:
            if d in full or (profile is not None and not profile.can_run(op.id, d)):
                continue
            need = (
                sum(nbytes[v] for v in ins - held[d]) + sum(nbytes[v] for v in op.outputs) + _workspace(op, d, profile)
            )
            if d not in budgets or used[d] + need <= budgets[d]:
                break
            full.add(d)  # accelerate never goes back to a device once the next one has started
        else:
            runnable = [d for d in devices if profile is None or profile.can_run(op.id, d)]
            raise BudgetError(
                f"greedy fill ran out of devices at op {op.id}: "
                + ", ".join(
                    f"{d} holds {format_bytes(used[d])} of {format_bytes(budgets.get(d, 0))}" for d in runnable
                ),
                stage="solve",
                op=op.id,
                device=runnable[-1] if runnable else None,
            )
        assignment[op.id] = d
        for v in (ins - held[d]) | set(op.outputs):
            held[d].add(v)
            used[d] += nbytes[v]
        for v in ins | set(op.outputs):
            if v not in keep and last_use.get(v, -1) <= i:
                for e in devices:
                    if v in held[e] and homes.get(v) != e:
                        held[e].discard(v)
                        used[e] -= nbytes[v]
    computes = [Compute(o.id, assignment[o.id]) for o in graph.ops]
    return _route_and_finish(
        graph, computes, "greedy", budgets, homes, profile, t0, devices_used=sorted(set(assignment.values()))
    )


def _workspace(op, device: str, profile: Profile | None) -> int:  # noqa: ANN001
    cost = profile.op_cost(op.id, device) if profile is not None else None
    return max(op.workspace_bytes, cost.workspace_bytes if cost else 0)


def fastest(
    graph: Graph, profile: Profile, budgets: Mapping[str, int], devices: Sequence[str], homes: Mapping[str, str]
) -> Plan:
    """Each op on the device where it runs fastest, ignoring copies; then the copies it needs."""
    t0 = time.perf_counter()
    assignment = {}
    for op in graph.ops:
        times = [(c.time_s, k, d) for k, d in enumerate(devices) if (c := profile.op_cost(op.id, d)) is not None]
        if not times:
            raise BudgetError(f"op cannot run on any of {', '.join(devices)}", stage="solve", op=op.id)
        assignment[op.id] = min(times)[2]
    computes = [Compute(o.id, assignment[o.id]) for o in graph.ops]
    return _route_and_finish(graph, computes, "fastest", budgets, homes, profile, t0)


# ---------------------------------------------------------------- checkpointing (Chen et al. 2016)


def droppable(graph: Graph) -> list[str]:
    """Forward activations that checkpointing may free after their forward uses, in graph order."""
    outputs = set(graph.outputs)
    return [v for o in graph.ops if o.phase == "fwd" for v in o.outputs if v not in outputs]


def checkpoint_computes(graph: Graph, keep: set[str], device: str) -> list[Compute]:
    """Graph order with recomputation: forward values not in `keep` are dropped after their last
    forward (non-backward) use; a later op that needs one recomputes it, and recursively whatever of
    its ancestors is missing, from what is still held. Recomputed values are held until their last
    use (route/place_frees free them), so each is recomputed at most once.
    """
    drop = set(droppable(graph)) - keep
    fwd_last = {
        v: max((graph.op_index[c] for c in cs if graph.op[c].phase != "bwd"), default=-1)
        for v, cs in graph.consumers.items()
    }
    held = set(graph.inputs)
    out: list[Compute] = []

    def ensure(v: str) -> None:
        stack = [v]
        while stack:
            x = stack[-1]
            if x in held:
                stack.pop()
                continue
            p = graph.op[graph.producer[x]]
            missing = [u for u in p.inputs if u not in held]
            if missing:
                stack.extend(missing)
                continue
            out.append(Compute(p.id, device))
            held.update(p.outputs)
            stack.pop()

    for i, op in enumerate(graph.ops):
        for v in op.inputs:
            ensure(v)
        out.append(Compute(op.id, device))
        held.update(op.outputs)
        if op.phase != "bwd":
            held.difference_update(v for v in (*op.inputs, *op.outputs) if v in drop and fwd_last[v] <= i)
    return out


def checkpoint_plan(
    graph: Graph,
    keep: set[str],
    device: str,
    profile: Profile | None = None,
    *,
    budgets: Mapping[str, int] | None = None,
    homes: Mapping[str, str] | None = None,
    name: str = "checkpoint",
) -> Plan:
    """One-device plan keeping only `keep` (plus what is never dropped) and recomputing the rest on demand."""
    t0 = time.perf_counter()
    homes = homes if homes is not None else {v: device for v in graph.inputs}
    computes = checkpoint_computes(graph, keep, device)
    recomputes = len(computes) - len(graph.ops)
    return _route_and_finish(
        graph, computes, name, budgets or {}, homes, profile, t0, device=device, kept=len(keep), recomputes=recomputes
    )


def sqrt_keep(graph: Graph, spacing: int | None = None) -> set[str]:
    """Every `spacing`-th droppable forward value (default ceil(sqrt(n))): Chen et al.'s sqrt(n) checkpoints."""
    cands = droppable(graph)
    k = spacing or max(1, math.ceil(math.sqrt(len(cands))))
    return set(cands[k - 1 :: k])


def threshold_keep(graph: Graph, threshold: int) -> set[str]:
    """Chen et al.'s memory-planned segmentation: a checkpoint whenever the bytes since the last one pass `threshold`."""
    keep, acc = set(), 0
    for v in droppable(graph):
        acc += graph.value[v].nbytes
        if acc > threshold:
            keep.add(v)
            acc = 0
    return keep


def sqrt_checkpoint(
    graph: Graph, profile: Profile | None, budgets: Mapping[str, int], devices: Sequence[str], homes: Mapping[str, str]
) -> Plan:
    """sqrt(n) checkpointing on the fastest single device whose plan fits the budgets."""
    keep = sqrt_keep(graph)

    def on(d: str) -> Plan:
        return checkpoint_plan(graph, keep, d, profile, budgets=budgets, homes=homes, name="sqrt")

    return best_single_device(on, graph, profile, devices, "sqrt")


def candidate_keeps(graph: Graph) -> list[set[str]]:
    """Keep sets to search: every spacing (geometric past 64) and Chen's byte thresholds, deduplicated."""
    cands = droppable(graph)
    n = len(cands)
    spacings = sorted({*range(1, min(n, 64) + 1), *(int(round(1.25**k)) for k in range(1, 64) if 1.25**k <= n), n + 1})
    keeps = [sqrt_keep(graph, s) for s in spacings]
    total = sum(graph.value[v].nbytes for v in cands)
    if total > 0:
        keeps += [threshold_keep(graph, int(total * 0.8**k)) for k in range(1, 40)]
    unique: dict[frozenset[str], set[str]] = {}
    for k in keeps:
        unique.setdefault(frozenset(k), k)
    return list(unique.values())


def evict_computes(graph: Graph, device: str, budget: int, profile: Profile | None = None) -> list[Compute]:
    """Graph order under a byte budget, evicting and recomputing on demand (in the spirit of DTR,
    Kirisame et al. 2021): when an op does not fit, evict the held value with the lowest
    recompute time / (bytes x distance to its next use), and recompute evicted values, and their
    missing ancestors, when they are needed again. Works on any DAG, not only fwd/bwd graphs.

    The tracker holds every value until its last consumer or its eviction and every graph input
    from the start, so the routed plan (frees after last reads) never needs more than it saw.
    What the ops waiting on the recompute stack hold is never evicted, so nothing is recomputed in circles.
    """
    nbytes = {v.id: v.nbytes for v in graph.values}
    cost = {o.id: (c.time_s if profile and (c := profile.op_cost(o.id, device)) else 1.0) for o in graph.ops}
    uses: dict[str, list[int]] = {v: [graph.op_index[c] for c in reversed(cs)] for v, cs in graph.consumers.items()}
    fixed = set(graph.inputs) | set(graph.outputs)
    held = set(graph.inputs)
    used = sum(nbytes[v] for v in held)
    out: list[Compute] = []

    def redo_cost(v: str, memo: dict[str, float], depth: int = 0) -> float:
        """Time to recompute v: its producer plus, recursively, its missing ancestors (DTR's e*).
        An estimate: past 32 levels only the producer counts, which keeps the recursion shallow."""
        if v not in memo:
            p = graph.op[graph.producer[v]]
            missing = [u for u in p.inputs if u not in held] if depth < 32 else []
            memo[v] = cost[p.id] + sum(redo_cost(u, memo, depth + 1) for u in missing)
        return memo[v]

    def evict_score(v: str, now: int, memo: dict[str, float]) -> float:
        """Lowest goes first: cheap to redo, big, and needed late; values no later op reads go first of all."""
        return redo_cost(v, memo) / (nbytes[v] * (uses[v][-1] - now + 1)) if uses[v] else -1.0

    for i, root in enumerate(graph.ops):
        stack = [root.id]
        while stack:
            op = graph.op[stack[-1]]
            if len(stack) > 1 and all(v in held for v in op.outputs):
                stack.pop()  # pushed twice for the same missing value: already recomputed
                continue
            missing = [graph.producer[v] for v in op.inputs if v not in held]
            if missing:
                stack.extend(dict.fromkeys(missing))
                continue
            need = sum(nbytes[v] for v in op.outputs) + _workspace(op, device, profile)
            pinned = {v for x in stack for v in (*graph.op[x].inputs, *graph.op[x].outputs)}
            while used + need > budget:
                victims = [v for v in held - pinned - fixed if nbytes[v] > 0]
                if not victims:
                    raise BudgetError(
                        f"eviction cannot fit op {op.id} in {format_bytes(budget)} on {device}: "
                        f"{format_bytes(used)} held by its inputs and fixed values, {format_bytes(need)} more needed",
                        stage="solve", op=op.id, device=device,
                    )  # fmt: skip
                v = min(victims, key=lambda v, now=i, memo={}: evict_score(v, now, memo))
                held.discard(v)
                used -= nbytes[v]
            out.append(Compute(op.id, device))
            fresh = [v for v in op.outputs if v not in held]
            held.update(fresh)
            used += sum(nbytes[v] for v in fresh)
            stack.pop()
        for v in dict.fromkeys((*root.inputs, *root.outputs)):
            while uses[v] and uses[v][-1] <= i:
                uses[v].pop()
            if not uses[v] and v not in fixed and v in held:
                held.discard(v)
                used -= nbytes[v]
    return out


def checkpoint_search(
    graph: Graph, profile: Profile | None, budgets: Mapping[str, int], devices: Sequence[str], homes: Mapping[str, str]
) -> Plan:
    """Budget-driven checkpointing: the fastest fitting plan over Chen-style keep sets (spacings and
    byte thresholds) and budget-driven eviction, on each device that can run every op."""
    keeps = candidate_keeps(graph)

    def on(d: str) -> Plan:
        t0 = time.perf_counter()
        candidates = [(f"keep {len(k)}", lambda k=k: checkpoint_computes(graph, k, d)) for k in keeps]
        if d in budgets:
            candidates.append(("evict", lambda: evict_computes(graph, d, budgets[d], profile)))
        fits: list[tuple[float, int, str, list[Compute]]] = []
        lowest: tuple[int, str] | None = None  # the leanest plan seen: peak on d, label
        for label, make in candidates:
            try:
                computes = make()
            except BudgetError:
                continue
            plan = finish(graph, route(graph, computes, homes, profile), "checkpoint", {}, homes, profile, t0)
            peaks = plan.predicted.peak_bytes
            if all(peaks.get(e, 0) <= b for e, b in budgets.items()):
                fits.append((plan.predicted.time_s or 0.0, len(fits), label, computes))
            if lowest is None or peaks.get(d, 0) < lowest[0]:
                lowest = (peaks.get(d, 0), label)
        if not fits:
            peak, label = lowest or (0, "none")
            raise BudgetError(
                f"none of {len(candidates)} checkpoint candidates fits; the leanest ({label}) peaks at "
                f"{format_bytes(peak)} on {d} (budget {format_bytes(budgets.get(d, 0))})",
                stage="solve",
                device=d,
            )
        _, _, label, computes = min(fits, key=lambda f: f[:2])
        return _route_and_finish(
            graph, computes, "checkpoint", budgets, homes, profile, t0, device=d, variant=label,
            recomputes=len(computes) - len(graph.ops), candidates=len(candidates),
        )  # fmt: skip

    return best_single_device(on, graph, profile, devices, "checkpoint")


HEURISTICS: dict[str, Callable[..., Plan]] = {
    "eager": eager,
    "greedy": greedy_fill,
    "fastest": fastest,
    "sqrt": sqrt_checkpoint,
    "checkpoint": checkpoint_search,
}


def best_heuristic(
    graph: Graph, profile: Profile, budgets: Mapping[str, int], devices: Sequence[str], homes: Mapping[str, str]
) -> tuple[Plan | None, dict[str, str]]:
    """The fastest plan among all heuristics that meet the budgets, and why each other one failed."""
    plans, why = [], {}
    for name, fn in HEURISTICS.items():
        try:
            plans.append(fn(graph, profile, budgets, devices, homes))
        except XschedError as e:
            why[name] = e.detail
    best = min(plans, key=lambda p: p.predicted.time_s or 0.0, default=None)
    return best, why
