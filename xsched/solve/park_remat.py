"""Parking and recomputation chosen together (POFO's idea on any DAG): gap rematerialization whose every step, at
the memory peak, either runs a value's producer again before its next read or parks the value on a store device
(copied out after its last use, freed once the copy is done, copied back ahead of its next read), whichever adds
the least time per byte freed there. The links' capacity is part of the choice: a copy moves at its link's speed
while the device computes, so parking more than a link can move in the time available costs the stall it causes."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

from xsched.budgets import format_bytes
from xsched.contracts.graph import Graph
from xsched.contracts.plan import Compute, Copy, Free, Plan, Step
from xsched.contracts.profile import Profile
from xsched.errors import BudgetError, PlanError
from xsched.solve.gap_remat import MAX_DEPTH, MAX_DROPS
from xsched.solve.objective import best_of
from xsched.solve.order import starting_orders
from xsched.solve.park_model import EndRerun, Park, ParkTimeline
from xsched.solve.routing import finish, route

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
) -> ParkTimeline:
    """`order` with reruns and parked values: while the peak is over `budget`, apply the drop or park at the peak
    with the least added time per byte freed there (a drop's rerun time; a park's stall and link price; no park
    with price None). BudgetError when nothing lowers the peak."""
    out, back = profile.link(device, store), profile.link(store, device)
    if out is None or back is None:
        raise PlanError(f"no copy link between {device} and {store} in the profile", stage="solve", device=store)
    line = ParkTimeline(graph, order, device, profile, store, out, back, homes)
    cost = {o.id: (c.time_s if (c := profile.op_cost(o.id, device)) else 1.0) for o in graph.ops}
    for _ in range(MAX_DROPS * len(graph.ops)):
        t = int(line.mem.argmax())
        if line.mem[t] <= budget:
            return line
        best = None
        for rank, v in enumerate(line.spans):
            if line.nbytes[v] == 0:
                continue
            for k, (s, e) in enumerate(line.spans[v]):
                if not s < t < e:
                    continue
                if v not in line.fixed and (d := line.drop(v, k, t, budget, depth)) is not None:
                    key = (sum(cost[p] for p in d.reruns) / -d.delta[t - d.lo], 0.0, rank)
                    if best is None or key < best[0]:
                        best = (key, d)
                if price is not None and (pk := line.park(v, k, t, price)) is not None:
                    key = (pk.cost / line.nbytes[v], 0.0, rank)
                    if best is None or key < best[0]:
                        best = (key, pk)
                if (er := line.end_rerun(v, k, t, budget)) is not None:
                    key = (cost[er.producer] / -er.delta[t - er.lo], 0.0, rank)
                    if best is None or key < best[0]:
                        best = (key, er)
        if best is None:
            raise BudgetError(
                f"parking and recomputing cannot lower the peak at {line.ops[t].id}: "
                f"{format_bytes(int(line.mem[t]))} over a budget of {format_bytes(budget)} on {device}",
                stage="solve",
                op=line.ops[t].id,
                device=device,
            )
        move = best[1]
        if isinstance(move, Park):
            line.apply_park(move)
        elif isinstance(move, EndRerun):
            line.apply_end(move)
            line.refresh()
        else:
            line.apply(move)
            line.refresh()
    raise BudgetError(f"parking and recomputing gave up on {device}", stage="solve", device=device)


def park_steps(graph: Graph, line: ParkTimeline, homes: Mapping[str, str], profile: Profile) -> tuple[Step, ...]:
    """The timeline as plan steps: its computes (reruns first) routed with frees after last reads, then each park's
    steps put in: the copy out right after the compute that makes the value, the free before the first step of the
    position where the value stops being resident (its final spans say where: a later rerun may hold it longer), the
    copy back before the position where it is resident again, and the store's copy freed after its last copy back."""
    main: list[Compute] = []
    computes: list[Compute] = []
    for t, op in enumerate(line.ops):
        reruns = sorted(set(line.redo.get(t, ())), key=graph.op_index.__getitem__)
        computes += [Compute(p, line.device) for p in reruns]
        main.append(Compute(op.id, line.device))
        computes.append(main[-1])
    computes += [Compute(p, line.device) for p in line.end_redo]
    steps = list(route(graph, computes, homes, profile))
    group = _group_starts(steps, main)
    before: dict[int, list[tuple[int, Step]]] = {}  # step index -> (rank, step) to put before it
    after: dict[int, list[Step]] = {}  # step index -> steps to put after it
    last_back: dict[str, int] = {}  # value -> the step index its last copy back goes before
    parks: dict[str, list[tuple[Park, int, int]]] = {}  # value -> (park, free index, copy back index)
    skip: set[str] = set()
    for pk in line.parks:
        window = _window(line, pk.value, pk)
        if window is None:  # a later rerun holds it across the gap after all
            skip.add(pk.value)
            continue
        i0 = group[window[0]]
        i1 = group[window[1]] if window[1] < len(line.ops) else _NEVER
        if not _stays(_runs(graph, steps, pk.value, line.device), i0, i1):  # made again by a rerun in between
            skip.add(pk.value)
        parks.setdefault(pk.value, []).append((pk, i0, i1))
    for v, items in parks.items():
        if v in skip:  # the routed steps already do without parking it: park none of its gaps
            continue
        for pk, i0, i1 in items:
            if pk.out:
                after.setdefault(_maker(steps, group, graph, v, pk.a), []).append(Copy(v, line.device, line.store))
            before.setdefault(i0, []).append((0, Free(v, line.device)))
            if i1 != _NEVER:
                before.setdefault(i1, []).append((1, Copy(v, line.store, line.device)))
                last_back[v] = max(last_back.get(v, -1), i1)
    for v, i in last_back.items():  # the store's copy goes once its last copy back has read it
        if all(pk.b is not None for pk, _, _ in parks[v]):
            before[i].append((2, Free(v, line.store)))
    out: list[Step] = []
    for i, s in enumerate(steps):
        out += [x for _, x in sorted(before.get(i, ()), key=lambda r: r[0])]  # frees, copies back, store frees
        out.append(s)
        out += after.get(i, ())
    return tuple(out)


_NEVER = 1 << 62  # a step index past any plan's end


def _runs(graph: Graph, steps: Sequence[Step], v: str, device: str) -> list[tuple[int, int]]:
    """The residencies of v on `device` in routed steps (no parking yet): (index of the step that makes it, index
    of the free that ends it, or _NEVER)."""
    runs, start = [], None
    for i, s in enumerate(steps):
        if isinstance(s, Compute) and s.device == device and v in graph.op[s.op].outputs and start is None:
            start = i
        elif isinstance(s, Copy) and s.dst == device and s.value == v and start is None:
            start = i
        elif isinstance(s, Free) and s.device == device and s.value == v and start is not None:
            runs.append((start, i))
            start = None
    return runs + ([(start, _NEVER)] if start is not None else [])


def _stays(runs: Sequence[tuple[int, int]], i0: int, i1: int) -> bool:
    """One residency spans the park's window [i0, i1) (so its free and copy back fit in) and none starts in it."""
    return any(m < i0 and f >= i1 for m, f in runs) and not any(i0 <= m < i1 for m, _ in runs)


def _group_starts(steps: Sequence[Step], main: Sequence[Compute]) -> list[int]:
    """For each position, the index of its first step: what follows the previous position's compute and frees."""
    ids = {id(c): t for t, c in enumerate(main)}
    starts, t_prev = [0], 0
    for i, s in enumerate(steps):
        if len(starts) <= t_prev and not isinstance(s, Free):
            starts.append(i)
        if id(s) in ids:
            t_prev = ids[id(s)] + 1
    while len(starts) <= len(main):
        starts.append(len(steps))
    return starts


def _window(line: ParkTimeline, v: str, pk: Park) -> tuple[int, int] | None:
    """Where the value is off the compute device around this park by its final spans: (first position off, first
    position back on, len(ops) for never), or None when no position of the park's gap is off any more."""
    spans = sorted(line.spans[v])
    held_to = max((e for s, e in spans if s <= pk.q - 1), default=None)
    start = max(pk.q, (held_to + 1) if held_to is not None else pk.q)
    nxt = min((s for s, _ in spans if s >= start), default=len(line.ops))
    return (start, nxt) if start < nxt and (pk.b is None or nxt == pk.p) else None


def _maker(steps: Sequence[Step], group: Sequence[int], graph: Graph, v: str, t: int) -> int:
    """The index of the step of position t's group that makes v (a compute, or a copy into the compute device)."""
    end = group[t + 1] if t + 1 < len(group) else len(steps)
    for i in range(group[t], end):
        s = steps[i]
        if (isinstance(s, Compute) and v in graph.op[s.op].outputs) or (isinstance(s, Copy) and s.value == v):
            return i
    raise AssertionError(f"no step of position {t} makes {v}")


def park_remat(
    graph: Graph, profile: Profile | None, budgets: Mapping[str, int], devices: Sequence[str], homes: Mapping[str, str]
) -> Plan:
    """Parking and recomputation chosen together: each device that runs every op, with each other device it has
    links to as its store, over the starting orders, rerun depths and link prices; the fastest plan that fits."""
    t0 = time.perf_counter()
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
    plans, why = [], []
    orders = starting_orders(graph)
    for c, store in pairs:
        limit = budgets.get(c, 1 << 62)  # no budget: each order as it is
        for name, order in orders.items():
            for depth in (0, MAX_DEPTH):
                for price in PRICES:
                    try:
                        line = park_computes(graph, order, c, store, limit, profile, homes, depth, price)
                        steps = park_steps(graph, line, homes, profile)
                        plans.append(_finish(graph, steps, line, budgets, homes, profile, t0, name, depth))
                    except BudgetError as e:
                        why.append(f"{c}/{store} {name} order, depth {depth}, price {price}: {e.detail}")
    if not plans:
        raise BudgetError("park: " + "; ".join(why[:3]), stage="solve", device=pairs[0][0])
    return best_of(plans)


def _finish(graph, steps, line, budgets, homes, profile, t0, name, depth) -> Plan:
    parked = sum(isinstance(s, Copy) and s.src == line.device for s in steps)
    recomputes = sum(isinstance(s, Compute) for s in steps) - len(graph.ops)
    facts = dict(device=line.device, order=name, depth=depth, recomputes=recomputes, parked=parked)
    return finish(graph, steps, "park", budgets, homes, profile, t0, **facts)
