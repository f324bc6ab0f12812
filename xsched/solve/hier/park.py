"""Park options of a block: on a machine with a store (a device that runs no op, linked both ways), the `park`
heuristic on the block's own graph at a grid of budgets gives schedules that copy some of its values out after
they are made and back before they are read, so the level above can trade recomputing against parking block by
block. Parts that copy to or from a store are priced by their makespan on the lanes (`xsched.lanes`: the copies
move while the device computes), and the flattened plan keeps each parked value's free where the block's own
schedule put it (after the copy out has had time to finish), so the computes in between need not wait for it."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import replace

from xsched.contracts.graph import Graph
from xsched.contracts.plan import Compute, Copy, Free, Plan, Step
from xsched.contracts.profile import Profile
from xsched.contracts.random_ops import random_ops
from xsched.errors import XschedError
from xsched.lanes import timed_spans

# budgets of a block's park plans, between its leanest (0) and fastest (1) recompute-only peaks, and below the
# leanest (negative: that share of it less), where parking goes further than recomputing
PARK_SHARES = (-0.3, -0.15, 0.0, 0.3, 0.6)
PARK_PRICE = 0.0  # the park heuristic's link price: park whenever the link has room (its best on GPT-2 at 45-55%)


def with_stores(profile: Profile) -> Profile:
    """The profile with its stores (devices that run no op) declared: hier's sub-profiles keep only a block's ops,
    so a computing device that runs none of them would look like a store there; they carry the whole graph's."""
    stores = tuple(d for d in profile.devices if profile.is_store(d))
    return profile if stores == profile.stores else replace(profile, stores=stores)


def stores_for(profile: Profile, device: str, devices: Sequence[str]) -> list[str]:
    """The stores (declared: `with_stores`) among `devices` with links to and from `device`."""
    return [s for s in devices if s in profile.stores and profile.link(device, s) and profile.link(s, device)]


def park_plans(
    graph: Graph, profile: Profile, device: str, homes: Mapping[str, str], peaks: Sequence[int], devices: Sequence[str]
) -> list[tuple[Plan, str]]:
    """The park heuristic's plans of a block's graph on `device` with each store, at PARK_SHARES between the
    least and the most of `peaks` (its recompute-only plans' peaks there), each with its label; budgets where it
    finds none are skipped."""
    lean, fast = min(peaks), max(peaks)
    from xsched.solve.heuristics.park import park_variant

    order = tuple(range(len(graph.ops)))  # graph order: the block's forward part, then its backward part
    out: list[tuple[Plan, str]] = []
    seen: set[tuple[Step, ...]] = set()
    for store in stores_for(profile, device, devices):
        for share in PARK_SHARES:
            budgets = {device: int(lean + share * (fast - lean) if share >= 0 else lean * (1 + share))}
            try:
                plan = park_variant(
                    graph,
                    profile,
                    budgets,
                    homes,
                    device,
                    store,
                    "graph",
                    order,
                    0,
                    PARK_PRICE,
                    1.0,
                    time.perf_counter(),
                )
            except XschedError:
                continue  # nothing fits this budget (or the boundary rule fails): the other budgets still count
            if plan.steps not in seen and any(isinstance(s, Copy) and s.dst == store for s in plan.steps):
                seen.add(plan.steps)
                out.append((plan, f"park:{store}@{share:g}"))
    return out


def parks(steps: Sequence[Step], profile: Profile) -> bool:
    """Whether the steps copy to or from a (declared) store."""
    return any(isinstance(s, Copy) and (s.dst in profile.stores or s.src in profile.stores) for s in steps)


def lanes_time(g: Graph, profile: Profile, steps: Sequence[Step]) -> float:
    """The steps' makespan on the lanes, from what they start with (xsched.lanes: each lane in order, a step
    waiting for what it reads, a compute for the frees before it on its device)."""
    size = {v.id: v.nbytes for v in g.values}
    durations = []
    for s in steps:
        if isinstance(s, Compute):
            cost = profile.op_cost(s.op, s.device)
            durations.append(cost.time_s if cost else 0.0)
        elif isinstance(s, Copy):
            durations.append(profile.copy_time(s.value, size[s.value], s.src, s.dst) or 0.0)
        else:
            durations.append(0.0)
    spans = timed_spans(g, steps, durations, random_ops(g))
    return max((e for _, e in spans), default=0.0)


def kept_frees(graph: Graph, steps: Sequence[Step], profile: Profile) -> set[int]:
    """Indices of the frees that end a residency copied to a store earlier in `steps`, not made again since: a
    parked value's free, which a block's schedule places after its copy out has had time to finish."""
    return {i for i, _, _ in _parked(graph, steps, profile)}


def _parked(graph: Graph, steps: Sequence[Step], profile: Profile) -> list[tuple[int, int, int]]:
    """(index in `steps`, index among the non-free steps it precedes, that of its copy out) of each parked value's
    free."""
    out_to_store: dict[tuple[str, str], int] = {}  # residency -> its copy out, counted in non-free steps
    found: list[tuple[int, int, int]] = []
    k = 0
    for i, s in enumerate(steps):
        if isinstance(s, Free):
            if (s.value, s.device) in out_to_store:
                found.append((i, k, out_to_store.pop((s.value, s.device))))
            continue
        if isinstance(s, Copy):
            out_to_store.pop((s.value, s.dst), None)
            if s.dst in profile.stores:
                out_to_store[(s.value, s.src)] = k
        else:
            for v in graph.op[s.op].outputs:
                out_to_store.pop((v, s.device), None)
        k += 1
    return found


def with_kept_frees(graph: Graph, steps: Sequence[Step], placed: Sequence[Step], profile: Profile) -> list[Step]:
    """`placed` (place_frees of `steps`: every residency freed after its last read) with each parked value's free
    moved back to where `steps` has it (before the same non-free step), when that is later."""
    anchors = [((steps[i].value, steps[i].device), at, out) for i, at, out in _parked(graph, steps, profile)]
    if not anchors:
        return list(placed)
    # in `placed`, each step with the count of non-free steps before it; each residency's frees there
    counted: list[tuple[int, Step]] = []
    frees: dict[tuple[str, str], list[int]] = {}
    k = 0
    for s in placed:
        if isinstance(s, Free):
            frees.setdefault((s.value, s.device), []).append(len(counted))
        counted.append((k, s))
        if not isinstance(s, Free):
            k += 1
    moves: set[int] = set()  # indices in `placed` of the frees moved later
    before: dict[int, list[Free]] = {}  # non-free index -> frees to insert before it
    for key, at, out in anchors:
        # place_frees' free of the same residency: after its copy out, before the anchor (else it is read later)
        auto = [i for i in frees.get(key, ()) if out < counted[i][0] < at]
        if auto and auto[-1] not in moves:
            moves.add(auto[-1])
            before.setdefault(at, []).append(Free(*key))
    out: list[Step] = []
    for i, (c, s) in enumerate(counted):
        if i in moves:
            continue
        if not isinstance(s, Free):
            out += before.pop(c, [])
        out.append(s)
    for frees in before.values():  # anchors at the end
        out += frees
    return out
