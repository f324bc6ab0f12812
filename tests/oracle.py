"""Independent answers for a plan's figures, written from the contract's words (docs/ARCHITECTURE.md), not from
xsched.simulate or xsched.lanes: the sequential time and energy summed step by step, the memory peak per device
counted from a set of residencies, and the overlapped makespan by an event sweep over streams. Tests compare a
solver's prediction with these instead of with the simulator's own output."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from xsched.contracts.graph import Graph
from xsched.contracts.plan import Compute, Copy, Free, Plan
from xsched.contracts.profile import Profile


def sequential_time(graph: Graph, plan: Plan, profile: Profile) -> float:
    """Each compute's profiled time on its device plus each copy's link time."""
    total = 0.0
    for s in plan.steps:
        if isinstance(s, Compute):
            total += profile.compute[s.device][s.op].time_s
        elif isinstance(s, Copy):
            link = profile.copy[f"{s.src}->{s.dst}"]
            n = graph.value[s.value].nbytes
            total += link.per_value.get(s.value, link.latency_s + n / link.bytes_per_s)
    return total


def peaks(graph: Graph, plan: Plan, profile: Profile | None = None) -> dict[str, int]:
    """Per device, the most bytes resident at once: homed inputs from the start; a compute's outputs and workspace
    on top of what is resident while it runs; a copy counted on its destination from its start."""
    size = {v.id: v.nbytes for v in graph.values}
    resident = {(v, d) for v, d in plan.homes.items()}

    def used(d: str) -> int:
        return sum(size[v] for v, e in resident if e == d)

    top: dict[str, int] = {}
    for d in {d for _, d in resident}:
        top[d] = used(d)
    for s in plan.steps:
        if isinstance(s, Compute):
            op = graph.op[s.op]
            cost = profile.op_cost(op.id, s.device) if profile is not None else None
            ws = max(op.workspace_bytes, cost.workspace_bytes if cost else 0)
            during = used(s.device) + sum(size[v] for v in op.outputs) + ws
            top[s.device] = max(top.get(s.device, 0), during)
            resident.update((v, s.device) for v in op.outputs)
        elif isinstance(s, Copy):
            resident.add((s.value, s.dst))
            top[s.dst] = max(top.get(s.dst, 0), used(s.dst))
        else:
            resident.discard((s.value, s.device))
    return top


def makespan(graph: Graph, plan: Plan, profile: Profile) -> float:
    """The overlapped time by an event sweep: one compute stream per device and one copy stream per ordered pair,
    each running its steps in plan order; a step starts when its stream is free and what it needs is ready (a
    compute's inputs on its device, a copy's value on the source), and an allocating step also waits until every
    earlier free on its device could run (after the last read of what it frees, and after the compute before the
    free on its device). A copy also waits for the compute before it on its destination. Frees take no time. A
    random op's first run starts after the previous random op's first run ends."""
    from xsched.contracts.random_ops import random_ops

    randoms, drawn, last_draw = random_ops(graph), set(), 0.0
    ready: dict[tuple[str, str], float] = {(v, d): 0.0 for v, d in plan.homes.items()}
    last_read: dict[tuple[str, str], float] = {}
    stream: dict[str, float] = {}
    freed_at: dict[str, float] = {}  # device -> when its latest free (so far in plan order) can happen
    computed: dict[str, float] = {}  # device -> when its latest compute (so far in plan order) ends
    end = 0.0
    for s in plan.steps:
        if isinstance(s, Free):
            key = (s.value, s.device)
            t = max(ready.get(key, 0.0), last_read.pop(key, 0.0), computed.get(s.device, 0.0))
            freed_at[s.device] = max(freed_at.get(s.device, 0.0), t)
            continue
        if isinstance(s, Compute):
            op = graph.op[s.op]
            lane, dev, needs = f"c:{s.device}", s.device, [(v, s.device) for v in op.inputs]
            took = profile.compute[s.device][s.op].time_s
            made = [(v, s.device) for v in op.outputs]
        else:
            link = profile.copy[f"{s.src}->{s.dst}"]
            n = graph.value[s.value].nbytes
            lane, dev, needs = f"x:{s.src}->{s.dst}", s.dst, [(s.value, s.src)]
            took = link.per_value.get(s.value, link.latency_s + n / link.bytes_per_s)
            made = [(s.value, s.dst)]
        first_draw = isinstance(s, Compute) and s.op in randoms and s.op not in drawn
        after = [last_draw] if first_draw else []  # draws happen in plan order, as eager PyTorch makes them
        before = [computed.get(dev, 0.0)] if isinstance(s, Copy) else []  # the compute before a copy on its dst
        start = max([stream.get(lane, 0.0), freed_at.get(dev, 0.0), *after, *before, *(ready[k] for k in needs)])
        finish = start + took
        if isinstance(s, Compute):
            computed[dev] = finish
        if first_draw:
            drawn.add(s.op)
            last_draw = finish
        stream[lane] = finish
        for k in needs:
            last_read[k] = max(last_read.get(k, 0.0), finish)
        for k in made:
            ready[k] = finish
        end = max(end, finish)
    return end


def assert_prediction_matches(graph: Graph, plan: Plan, profile: Profile, budgets: Mapping[str, int] | None = None):
    """The plan's predicted sequential time and peaks equal the independent counts, within its budgets."""
    import pytest

    assert plan.predicted is not None
    assert plan.predicted.time_s == pytest.approx(sequential_time(graph, plan, profile), rel=1e-9, abs=1e-12)
    counted = peaks(graph, plan, profile)
    assert {d: b for d, b in plan.predicted.peak_bytes.items() if b} == {d: b for d, b in counted.items() if b}
    for d, b in (budgets if budgets is not None else plan.budgets).items():
        assert counted.get(d, 0) <= b, f"{d} peaks at {counted.get(d, 0)} over its budget {b}"


def residencies(graph: Graph, plan: Plan) -> Iterator[set[tuple[str, str]]]:
    """Per step, the (value, device) pairs resident once it has run, from the homes: a compute adds its outputs, a
    copy its value on the destination, a free removes. One set, updated in place."""
    resident = set(plan.homes.items())
    for s in plan.steps:
        if isinstance(s, Compute):
            resident.update((v, s.device) for v in graph.op[s.op].outputs)
        elif isinstance(s, Copy):
            resident.add((s.value, s.dst))
        else:
            resident.discard((s.value, s.device))
        yield resident


def resident_at_end(graph: Graph, plan: Plan) -> set[tuple[str, str]]:
    """The (value, device) pairs still resident after the last step."""
    end = set(plan.homes.items())
    for resident in residencies(graph, plan):
        end = resident
    return set(end)


def resident_after(graph: Graph, plan: Plan) -> list[dict[str, int]]:
    """Per step, the bytes resident on each device once it has run, counted from the set of residencies (devices
    holding nothing left out)."""
    size = {v.id: v.nbytes for v in graph.values}
    out: list[dict[str, int]] = []
    for resident in residencies(graph, plan):
        held: dict[str, int] = {}
        for v, d in resident:
            held[d] = held.get(d, 0) + size[v]
        out.append({d: b for d, b in held.items() if b})
    return out


def assert_run_counts(graph: Graph, plan: Plan, resident: list, peak: Mapping[str, int]) -> None:
    """A run's bytes per device after each step and its peaks (what the interpreter held, real tensors checked
    against the graph's sizes) equal the independent counts."""
    assert [{d: b for d, b in r.items() if b} for r in resident] == resident_after(graph, plan)
    assert {d: b for d, b in peak.items() if b} == {d: b for d, b in peaks(graph, plan).items() if b}
