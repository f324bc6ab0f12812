"""The `checkpoint` heuristic: budget-driven checkpoint search over Chen et al.'s keep sets (2016) and DTR-style
eviction, with lean checkpointing as its last resort; and the checkpointing and eviction orders other heuristics
reuse (`sqrt`, `offload`, hier's bottom blocks)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence

from xsched.budgets import format_bytes
from xsched.contracts.graph import Graph, Op
from xsched.contracts.plan import Compute, Plan, ends_on_one_device
from xsched.contracts.profile import Profile
from xsched.contracts.result import HeuristicStats
from xsched.errors import BudgetError
from xsched.solve.heuristics import lean
from xsched.solve.heuristics.evict import evict_computes
from xsched.solve.heuristics.floor import resident_floor
from xsched.solve.heuristics.routing import best_single_device, finish, route, route_and_finish
from xsched.solve.objective import best_of, objective
from xsched.solve.options import DEFAULTS, SolverOptions, keeps_limit, out_of_time
from xsched.solve.problem import Problem

# ---------------------------------------------------------------- checkpointing (Chen et al. 2016)


def droppable(graph: Graph) -> list[str]:
    """Forward activations that checkpointing may free after their forward uses, in graph order."""
    outputs = set(graph.outputs)
    return [v for o in graph.ops if o.phase == "fwd" for v in o.outputs if v not in outputs]


def checkpoint_computes(
    graph: Graph, keep: set[str], device: str, *, order: Sequence[Op] | None = None, drop_recomputed: bool = False
) -> list[Compute]:
    """`order` (default graph order) with recomputation: forward values not in `keep` are dropped after their
    last forward (non-backward) use; a later op that needs one recomputes it, and recursively whatever of its
    ancestors is missing, from what is still held. Recomputed values are held until their last use (route/place_frees
    free them), so each is recomputed at most once; `drop_recomputed` drops them after every backward op instead, so each
    backward op holds only its own (more recomputation, less memory: `xsched.solve.heuristics.lean`).
    """
    order = graph.ops if order is None else order
    at = {op.id: i for i, op in enumerate(order)}
    drop = set(droppable(graph)) - keep
    fwd_last = {
        v: max((at[c] for c in cs if graph.op[c].phase != "bwd"), default=-1) for v, cs in graph.consumers.items()
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

    for i, op in enumerate(order):
        for v in op.inputs:
            ensure(v)
        out.append(Compute(op.id, device))
        held.update(op.outputs)
        if op.phase != "bwd":
            held.difference_update(v for v in (*op.inputs, *op.outputs) if v in drop and fwd_last[v] <= i)
        elif drop_recomputed:
            held.difference_update(drop)
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
    via: Sequence[str] = (),
) -> Plan:
    """One-device plan keeping only `keep` (plus what is never dropped) and recomputing the rest on demand; `via`:
    the devices a copy may pass through (route)."""
    t0 = time.perf_counter()
    homes = homes if homes is not None else {v: device for v in graph.inputs}
    computes = checkpoint_computes(graph, keep, device)
    recomputes = len(computes) - len(graph.ops)
    stats = HeuristicStats(device=device, kept=len(keep), recomputes=recomputes)
    return route_and_finish(graph, computes, name, budgets or {}, homes, profile, t0, stats, via)


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


_LATE = 1 << 62  # the peak lean_search is told for a candidate not planned for lack of time


def _or_none(make: Callable[[], list[Compute]]) -> list[Compute] | None:
    try:
        return make()
    except BudgetError:
        return None


def compute_time(computes: Sequence[Compute], profile: Profile | None) -> float:
    """The computes' own time on their devices (0 untimed): a lower bound on the time of any plan that runs them."""
    if profile is None:
        return 0.0
    return sum(c.time_s for s in computes if (c := profile.op_cost(s.op, s.device)) is not None)


@keeps_limit
def checkpoint_search(problem: Problem, options: SolverOptions = DEFAULTS, warm: Plan | None = None) -> Plan:
    """Budget-driven checkpointing: the best fitting plan (objective.better) over Chen-style keep sets (spacings
    and byte thresholds) and budget-driven eviction, on each device that can run every op."""
    graph, profile, budgets, homes = problem.graph, problem.profile, problem.budgets, problem.homes
    alpha, via = options.alpha_energy, problem.devices
    keeps = candidate_keeps(graph)

    def on(d: str) -> Plan:
        t0 = time.perf_counter()
        candidates = [(f"keep {len(k)}", lambda k=k: checkpoint_computes(graph, k, d)) for k in keeps]
        if d in budgets:
            candidates.append(("evict", lambda: evict_computes(graph, d, budgets[d], profile)))
        fits: list[tuple[int, Plan, str, list[Compute]]] = []  # rank among the candidates, plan, label, computes
        lowest: tuple[int, str] | None = None  # the leanest plan seen: peak on d, label

        ahead: dict[int, Plan] = {}  # planned by lean_search ahead of its consider (by the computes' id)

        def planned(computes: list[Compute]) -> Plan:
            """The computes routed, with peaks but no makespan: most candidates only need to say they do not fit."""
            if (plan := ahead.pop(id(computes), None)) is not None:
                return plan
            steps = route(graph, computes, homes, profile, via=via)
            return finish(graph, steps, "checkpoint", {}, homes, profile, t0, lanes=False)

        def plan_ahead(computes: list[Compute]) -> int:
            ahead[id(computes)] = plan = planned(computes)
            return plan.predicted.peak_bytes.get(d, 0)

        def consider(rank: int, label: str, computes: list[Compute], bounded: bool = False) -> int:
            """Plans the computes and returns their peak on d; `bounded`: only the fit counts (the peak returned
            may be a lower bound), so computes whose `resident_floor` is over d's budget are not planned."""
            nonlocal lowest
            if bounded and d in budgets and (floor := resident_floor(graph, computes, d, homes)) > budgets[d]:
                if lowest is None or floor < lowest[0]:
                    lowest = (floor, f"{label}, at least")
                return floor
            plan = planned(computes)
            peaks = plan.predicted.peak_bytes
            if all(peaks.get(e, 0) <= b for e, b in budgets.items()):  # ranked by makespan: timed on the lanes
                fits.append((rank, finish(graph, plan.steps, "checkpoint", {}, homes, profile, t0), label, computes))
            if lowest is None or peaks.get(d, 0) < lowest[0]:
                lowest = (peaks.get(d, 0), label)
            return peaks.get(d, 0)

        # eviction first (budget-driven, often the fastest), then the keep sets by their computes' own time, which
        # bounds their plan's time from below: once it exceeds the fastest fit, no later candidate can win
        # eviction made first: past the deadline no other candidate is made
        first = sorted(range(len(candidates)), key=lambda rank: candidates[rank][0] != "evict")
        made = [
            (label != "evict", compute_time(c, profile), rank, label, c)
            for n, (rank, (label, make)) in enumerate((rank, candidates[rank]) for rank in first)
            if not (n and out_of_time()) and (c := _or_none(make)) is not None
        ]
        for n, (keep_set, own_time, rank, label, computes) in enumerate(sorted(made, key=lambda m: m[:3])):
            if n and out_of_time():
                break
            # a bound, not a ranking: the objective is at least the makespan, which is at least the computes' time
            if fits and keep_set and own_time > min(objective(f[1], alpha) for f in fits):
                break
            consider(rank, label, computes, bounded=True)
        if not fits and d in budgets and not out_of_time():  # last resort: forward outputs evicted, made at the end
            if computes := _or_none(lambda: evict_computes(graph, d, budgets[d], profile, evict_outputs=True)):
                consider(len(candidates), "evict outputs", computes, bounded=True)
        if not fits and d in budgets:  # lean checkpointing, and windows of the backward made again at the end
            # past the deadline a candidate counts as no fit (the largest peak) without being planned
            least = lean_search(
                graph,
                keeps,
                d,
                homes,
                lambda label, c: _LATE if out_of_time() else consider(len(candidates), label, c),
                floor=lambda c, remade: resident_floor(graph, c, d, homes, remade),
                budget=budgets[d],
                plan_ahead=plan_ahead,
            )
            ahead.clear()  # what it planned and did not consider (out of time): the lists' ids may be reused
            if least is not None and (lowest is None or least[0] < lowest[0]):
                lowest = (least[0], f"{least[1]}, at least")
        if not fits:
            late = " before the time limit" if out_of_time() else ""  # some were not planned
            leanest = f"; the leanest ({lowest[1]}) peaks at {format_bytes(lowest[0])} on {d}" if lowest else ""
            raise BudgetError(
                f"none of {len(candidates)} checkpoint candidates {'was planned' if not lowest else 'fits'}{late}"
                f"{leanest} (budget {format_bytes(budgets.get(d, 0))})",
                stage="solve",
                device=d,
            )
        ranked = sorted(fits, key=lambda f: f[0])  # equals go to the first candidate
        best = best_of([f[1] for f in ranked], alpha)
        _, _, label, computes = next(f for f in ranked if f[1] is best)
        stats = HeuristicStats(
            device=d, variant=label, recomputes=len(computes) - len(graph.ops), candidates=len(candidates)
        )
        return route_and_finish(graph, computes, "checkpoint", budgets, homes, profile, t0, stats, via)

    return best_single_device(on, graph, profile, problem.devices, "checkpoint", alpha)


def lean_search(
    graph: Graph,
    keeps: Sequence[set[str]],
    device: str,
    homes: Mapping[str, str],
    consider: Callable[[str, list[Compute]], int],
    *,
    floor: Callable[[list[Compute], set[str]], int] | None = None,
    budget: float = math.inf,
    plan_ahead: Callable[[list[Compute]], int] | None = None,
) -> tuple[int, str] | None:
    """Hands `consider` (which plans labelled computes and returns their peak on `device`) lean checkpointing of
    every keep set, in graph order and with late gradients; then each gradient window made again after the
    `lean.BASES` leanest of those; then the leanest window after the next leanest, up to `lean.WINDOW_BASES`.
    With `floor` (a lower bound on the peak of computes and of any of them with computes appended that remake the
    given graph outputs) and `plan_ahead` (plans computes for their later `consider` and returns their peak),
    candidates over `budget` that cannot change what is tried next are not planned: the others are considered in
    the same order as without them. Where every candidate's floor is over `budget`, none is planned: returns the
    least floor and its label."""
    ends = ends_on_one_device(graph, homes)
    late = lean.late_gradient_order(graph, ends)
    orders = {"": None, "late ": late} if late != list(graph.ops) else {"": None}  # nothing moved: one order
    distinct: dict[tuple[str, ...], tuple[str, list[Compute]]] = {}  # keep sets that differ may compute alike
    for name, order in orders.items():
        for keep in keeps:
            if distinct and out_of_time():
                break
            computes = checkpoint_computes(graph, keep, device, order=order, drop_recomputed=True)
            distinct.setdefault(tuple(c.op for c in computes), (f"lean {name}keep {len(keep)}", computes))
    items = list(distinct.values())
    remakes = [lean.remake_window(graph, window, homes, device) for window in lean.gradient_windows(graph, ends)]
    remade = {v for remake in remakes for c in remake for v in graph.op[c.op].outputs}
    # floors that bound each base's windows too; 0 (none, or no time left to count it) plans it, as without a floor
    floors = [floor(c, remade) if floor is not None and not out_of_time() else 0 for _, c in items]
    if floor is not None and items and min(floors) > budget:  # no base, nor any base with a window, can fit
        return min((f, label) for f, (label, _) in zip(floors, items, strict=True))
    skip = _past_the_leanest(floors, budget, lambda j: plan_ahead(items[j][1])) if floor and plan_ahead else set()
    # a skipped one's floor is above the lean.WINDOW_BASES leanest peaks: it sorts after every base used below
    bases = sorted(
        ((floors[j] if j in skip else consider(label, c), label, c) for j, (label, c) in enumerate(items)),
        key=lambda b: b[0],
    )
    if not remakes:
        return None
    tried: list[tuple[int, int]] = []  # peak (or a floor over the budget and the least so far: never the least)
    for i, remake in enumerate(remakes):
        for _, label, computes in bases[: lean.BASES]:
            c, least = computes + remake, min(tried, default=(math.inf, 0))[0]
            f = floor(c, set()) if floor is not None and not out_of_time() else 0
            tried.append((f if f > budget and f > least else consider(f"{label} + window of {len(remake)}", c), i))
    remake = remakes[min(tried)[1]]
    for _, label, computes in bases[lean.BASES : lean.WINDOW_BASES]:  # only their fit counts
        c = computes + remake
        if floor is None or out_of_time() or floor(c, set()) <= budget:
            consider(f"{label} + window of {len(remake)}", c)
    return None


def _past_the_leanest(floors: Sequence[int], budget: float, plan_ahead: Callable[[int], int]) -> set[int]:
    """Plans candidates ahead (by index), lowest floor first, until the rest cannot fit (floor over `budget`) nor be
    among the `lean.WINDOW_BASES` leanest (floor over that many peaks); returns the rest, not planned."""
    peaks: list[int] = []
    order = sorted(range(len(floors)), key=lambda j: floors[j])
    for n, j in enumerate(order):
        if floors[j] > budget and sum(p < floors[j] for p in peaks) >= lean.WINDOW_BASES:
            return set(order[n:])
        if out_of_time():
            return set()  # consider reports the rest as late
        peaks.append(plan_ahead(j))
    return set()
