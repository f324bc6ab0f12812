"""Parking and recomputation chosen together (POFO's idea on any DAG): gap rematerialization whose every step, at
the memory peak, either runs a value's producer again before its next read or parks the value on a store device
(copied out after its last use, freed once the copy is done, copied back ahead of its next read), whichever adds
the least time per byte freed there. The links' capacity is part of the choice: a copy moves at its link's speed
while the device computes, so parking more than a link can move in the time available costs the stall it causes.
An output that must end on a third device (a gradient whose parameter lives there) may leave for good straight to
it instead of through the store, where that frees the device sooner."""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Mapping, Sequence

from xsched.contracts.graph import Graph
from xsched.contracts.plan import Compute, Copy, Plan
from xsched.contracts.profile import Profile
from xsched.contracts.result import HeuristicStats
from xsched.errors import BudgetError, NoIncumbent, PlanError
from xsched.solve.heuristics.gaps import MAX_DEPTH, MAX_DROPS
from xsched.solve.heuristics.park_floor import Floors
from xsched.solve.heuristics.park_hasten import (
    Hasten,
    Unpark,
    apply_hasten,
    apply_unpark,
    hastens,
    pins_leaving,
    unparks,
)
from xsched.solve.heuristics.park_model import EndRerun, Park, ParkTimeline
from xsched.solve.heuristics.park_plan_steps import park_steps
from xsched.solve.heuristics.routing import finish, home_copies_early
from xsched.solve.heuristics.timeline import op_seconds
from xsched.solve.objective import best_of, objective
from xsched.solve.options import (
    DEFAULTS,
    SolverOptions,
    good_enough,
    keeps_limit,
    note_unit,
    now,
    out_of_time,
    past_deadline,
)
from xsched.solve.order.order import starting_orders
from xsched.solve.problem import Problem, runnable

# the greedy's scores are a guide, not a measure of the step: park-search also runs it with each score scaled by
# 1 + JITTER x a uniform draw (seeded), keeping the fastest plan. GPT-2 on the H200 profile at 45%, 57 GB/s: the
# fixed variants' best is 1.1812x eager, 320 draws at 0.05 / 0.2 / 0.5 reached 1.1745x / 1.1706x / 1.1744x
JITTER = 0.2
# seconds of compute a second of link time is priced at: 0 parks whenever the link has room, more keeps the link for
# the values dear to recompute, None parks nothing (recomputation alone: no worse than gap rematerialization). Each
# is tried; the fastest plan wins. Measured on GPT-2 (H200 costs, 57 GB/s host link): 0 and 0.1 win at 45-55%
PRICES = (0.0, 0.1, 0.25, None)


def park_computes(
    graph: Graph,
    order: Sequence[int],
    device: str,
    store: str,
    budget: int,
    profile: Profile,
    homes: Mapping[str, str],
    depth: int = 0,
    price: float | None = 0.0,
    jitter: random.Random | None = None,
    stop: Callable[[], bool] | None = None,
) -> ParkTimeline:
    """`order` with reruns and parked values: while the peak is over `budget`, apply the drop or park at the peak
    with the least added time per byte freed there (a drop's rerun time; a park's stall and link price; no park
    with price None), each score times 1 + JITTER x a draw from `jitter` where given; where none lowers it, a move
    on a value parked already (`_parked_move`). Where that ends with nothing to lower a peak, once more with no drop
    whose rerun pins an output that may leave (`park_hasten.pins_leaving`): such reruns are often the cheapest
    moves (the plans they make stay as they were), but pin the chunked loss's logits over its backward at 25%.
    BudgetError when nothing lowers the peak; NoIncumbent when `stop` says so between two moves (one run takes
    seconds on a large graph)."""
    out, back = profile.link(device, store), profile.link(store, device)
    if out is None or back is None:
        raise PlanError(f"no copy link between {device} and {store} in the profile", stage="solve", device=store)
    cost = op_seconds(graph, device, profile)

    def noise() -> float:
        return 1.0 + JITTER * jitter.random() if jitter is not None else 1.0

    def run(keep_leaving: bool) -> ParkTimeline:
        line = ParkTimeline(graph, order, device, profile, store, out, back, homes)
        floors = Floors(line, price, cost)
        for _ in range(MAX_DROPS * len(graph.ops)):
            t = int(line.mem.argmax())
            if line.mem[t] <= budget:
                return line
            if stop is not None and stop():
                raise NoIncumbent(f"parking and recomputing on {device} stopped at the time limit", stage="solve")
            move = _best_move(line, t, budget, depth, price, cost, noise, jitter is None, floors, keep_leaving)
            if move is None:  # the values left over the peak are parked already, their copies out not done by then
                move = _parked_move(line, t, budget, depth, cost)
            if move is None:
                raise line.peak_error("parking and recomputing", t, budget)
            _apply(line, move)
        raise BudgetError(f"parking and recomputing gave up on {device}", stage="solve", device=device)

    try:
        return run(keep_leaving=False)
    except BudgetError:
        return run(keep_leaving=True)


def _apply(line: ParkTimeline, move) -> None:
    """Apply a move of any kind, the start times made again where it adds reruns."""
    if isinstance(move, Hasten):
        apply_hasten(line, move)
    elif isinstance(move, Unpark):
        apply_unpark(line, move)
    elif isinstance(move, Park):
        line.apply_park(move)
    elif isinstance(move, EndRerun):
        line.apply_end(move)
        line.refresh()
    else:
        line.apply(move)
        line.refresh()


def _best_move(
    line: ParkTimeline,
    t: int,
    budget: int,
    depth: int,
    price,
    cost,
    noise,
    exact: bool,
    floors=None,
    keep_leaving=False,
):
    """The move at the peak `t` with the least (score, rank): each span over `t`, in rank order, scored as a drop,
    a park (price None: none) and an end rerun. Ties go to the lower rank, so a value whose scores cannot go below
    the best so far (`Floors`) is not scored at all, nor a kind of move whose scores cannot, and a best of 0 ends
    the scan. Those only when `exact` (unjittered): each jittered score draws from the seeded stream, whose later
    draws must stay as they were. On GPT-2 with 48 layers and its weights on the host this skips most of the ~1000
    values over each peak. `floors`: the run's cache of them (one made here if None). `keep_leaving`: no drop whose
    rerun pins an output that may leave (`pins_leaving`)."""
    floors = floors if floors is not None else Floors(line, price, cost)
    best = None

    def tried(floor: float | None) -> bool:
        """A kind of move applies to the value (None: its method would return None before any draw) and, when
        `exact`, its floor is under the best score so far: a candidate at or above it loses to the best, by a
        higher score, or an equal one at the best's rank or a later one, where the earlier keeps the tie."""
        return floor is not None and not (exact and best is not None and floor >= best[0][0])

    # a span over t runs past it, except at the last position, where an output may have left for good before it (a
    # park with no way back: drops and end reruns find nothing there, having no later read and adding at the end):
    # it starts before t and ends at `te` or later
    te = t if t == len(line.ops) - 1 else t + 1
    for rank, (v, spans) in enumerate(line.spans.items()):
        if line.nbytes[v] == 0:
            continue
        if len(spans) == 1:  # most values: no list to build
            if spans[0][0] >= t or spans[0][1] < te:
                continue
            over: Sequence[int] = (0,)
        else:
            over = [k for k, (s, e) in enumerate(spans) if s < t and e >= te]
            if not over:
                continue
        drop_f, park_f, end_f, least = floors.of(v)
        if not tried(least):  # (no kind of move is tried where the least floor is not)
            continue
        for k in over:
            if (
                tried(drop_f)
                and (d := line.drop(v, k, t, budget, depth)) is not None
                and not (keep_leaving and pins_leaving(line, d))
            ):
                key = (sum(cost[p] for p in d.reruns) / d.freed(t) * noise(), 0.0, rank)
                if best is None or key < best[0]:
                    best = (key, d)
            if tried(park_f) and (pk := line.park(v, k, t, price)) is not None:
                key = (pk.cost / line.nbytes[v] * noise(), 0.0, rank)
                if best is None or key < best[0]:
                    best = (key, pk)
            if tried(end_f) and (er := line.end_rerun(v, k, t, budget)) is not None:
                key = (cost[er.producer] / er.freed(t) * noise(), 0.0, rank)
                if best is None or key < best[0]:
                    best = (key, er)
            if exact and best is not None and best[0][0] <= 0.0:
                return best[1]
    return best[1] if best is not None else None


def _parked_move(line: ParkTimeline, t: int, budget: int, depth: int, cost) -> Hasten | Unpark | None:
    """Where no move lowers the peak `t`, one on a value parked already whose copy out is not done by `t`: wait for
    the copy there (Hasten) or undo the park and drop the value instead (Unpark), whichever costs less per byte."""
    hs = hastens(line, t)
    scored = [((h.score(line), 0, h.index), h) for h in hs]
    scored += [((u.score(cost), 1, u.index), u) for u in unparks(line, hs, budget, depth)]
    return min(scored, key=lambda x: x[0])[1] if scored else None


@keeps_limit
def park_remat(problem: Problem, options: SolverOptions = DEFAULTS, warm: Plan | None = None) -> Plan:
    """Parking and recomputation chosen together: each device that runs every op, with each other device it has
    links to as its store, over the starting orders, rerun depths and link prices; the best plan that fits
    (objective.better; `park-search` tries more variants within a time limit)."""
    t0 = time.perf_counter()
    graph, profile, budgets, devices, homes = (
        problem.graph,
        problem.profile,
        problem.budgets,
        problem.devices,
        problem.homes,
    )
    plans, why = [], []
    variants = [
        (c, store, name, order, depth, price)
        for c, store in park_pairs(graph, profile, devices)
        for name, order in starting_orders(graph).items()
        for depth, price in ((d, p) for d in (0, MAX_DEPTH) for p in PRICES)
    ]
    as_is: set[tuple[str, str, str]] = set()  # (device, store, order) whose order fits with no move at all
    for k, (c, store, name, order, depth, price) in enumerate(variants):
        if k and out_of_time():  # the first variant runs however late: the most promising, and often the only fit
            why.insert(0, f"stopped at the time limit after {k} of {len(variants)} variants")
            break
        if plans and good_enough(min(objective(p, options.alpha_energy) for p in plans)):
            break  # within the run's gap of the lower bound: no later variant can gain more than the gap asked
        if (c, store, name) in as_is:  # depth and price only rank moves: none made, the same plan again
            continue
        started = now()
        try:  # a later variant stops at the deadline part-way (the first must give the caller a plan)
            line = park_line(
                graph, profile, budgets, homes, c, store, order, depth, price, 1.0, stop=past_deadline if k else None
            )
            if line.untouched:
                as_is.add((c, store, name))
            plans.append(line_plan(graph, profile, budgets, homes, line, name, depth, t0))
        except BudgetError as e:
            why.append(f"{c}/{store} {name} order, depth {depth}, price {price}: {e.detail}")
        except NoIncumbent:
            why.insert(0, f"stopped at the time limit in variant {k + 1} of {len(variants)}")
            break
        note_unit("park", now() - started)  # what park-search expects one of its runs to take
    if not plans:
        raise BudgetError("park: " + "; ".join(why[:3]), stage="solve", device=variants[0][0])
    return best_of(plans, options.alpha_energy)


def park_pairs(graph: Graph, profile: Profile | None, devices: Sequence[str]) -> list[tuple[str, str]]:
    """(compute device, store): a device that runs every op, and another with links both ways; BudgetError if none."""
    if profile is None:
        raise BudgetError("parking needs a profile (copy times)", stage="solve", device=devices[0] if devices else None)
    pairs = [
        (c, s)
        for c in devices
        for s in devices
        if c != s and profile.link(c, s) and profile.link(s, c) and all(profile.can_run(o.id, c) for o in graph.ops)
    ]
    if not pairs:
        raise BudgetError(
            f"parking needs a device that runs every op and a store with links both ways, got {list(devices)}",
            stage="solve",
            device=devices[0] if devices else None,
        )
    return pairs


def park_variant(
    graph, profile, budgets, homes, c, store, name, order, depth, price, aim, t0, jitter=None, stop=None
) -> Plan:
    """One run of the greedy (aiming at `aim` x the budget, its scores jittered by `jitter` if given, stopped by
    `stop` as park_computes is) made into a plan checked against the budgets."""
    line = park_line(graph, profile, budgets, homes, c, store, order, depth, price, aim, jitter, stop)
    return line_plan(graph, profile, budgets, homes, line, name, depth, t0)


def park_line(
    graph, profile, budgets, homes, c, store, order, depth, price, aim, jitter=None, stop=None
) -> ParkTimeline:
    """The greedy's timeline on `c` with `store`, aiming at `aim` x the budget (no budget: the order as it is)."""
    limit = int(budgets[c] * aim) if c in budgets else 1 << 62
    return park_computes(graph, order, c, store, limit, profile, homes, depth, price, jitter, stop)


def line_plan(graph, profile, budgets, homes, line: ParkTimeline, name: str, depth: int, t0: float) -> Plan:
    """The greedy's timeline as a plan checked against the budgets; its copies home issued early, or at the end
    (as park_steps leaves them) where holding them on their homes that much longer is over a home's budget."""
    late = park_steps(graph, line, homes, profile)
    # the copies home that routing left at the end, issued as their values are made (their frees stay: the timeline
    # holds them here to the end)
    steps = home_copies_early(graph, late, line.device, homes)
    parked = sum(isinstance(s, Copy) and s.src == line.device for s in steps)
    recomputes = sum(isinstance(s, Compute) for s in steps) - len(graph.ops)
    stats = HeuristicStats(device=line.device, order=name, depth=depth, recomputes=recomputes, parked=parked)
    try:
        plan = finish(graph, steps, "park", budgets, homes, profile, t0, stats=stats)
    except BudgetError as e:
        if e.device == line.device:  # the early copies hold nothing longer here: at the end, the same peak
            raise
        plan = finish(graph, late, "park", budgets, homes, profile, t0, stats=stats)
    # wrap's boundary rule, which the timeline does not model: repaired here or refused, so the fastest variant
    # that wrap can run wins (a variant breaking it would sink the whole method in the caller's check)
    return runnable(graph, plan, profile, budgets)
