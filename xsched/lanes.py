"""The overlapped execution model: the lane that runs each plan step, the earlier steps each waits for, and
the overlapped times that follow. The simulator's makespan and the executor's waits both come from here.

Lanes: one compute lane per device, one copy lane per ordered device pair, one free lane per device. A lane
runs its steps in plan order. Across lanes a step waits for
- a compute: the steps that made its inputs on its device, and the frees before it on its device (so an
  overlapped run never needs more memory than the plan frees);
- a copy: the step that made the value on the source, the frees before it on the destination, and the compute
  before it there (the plan has that compute's workspace released by then; overlapping it would hold both);
- a free: the step that made the value on its device, every read of it there, and the compute before it there
  (so a device's allocations and frees happen in plan order, and the run holds at each compute what the plan
  counts there: a free on its own lane would otherwise run as soon as its reads are done, before the computes
  the plan has it follow, and the run's memory would depend on which thread runs first);
- a random op's first run: the previous random op's first run, so draws happen in plan order, as eager
  PyTorch makes them (the RNG is shared by every lane).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from xsched.contracts.graph import Graph
from xsched.contracts.plan import Compute, Copy, Free, Step


def lane_of(step: Step) -> str:
    if isinstance(step, Compute):
        return f"compute:{step.device}"
    if isinstance(step, Copy):
        return f"copy:{step.src}->{step.dst}"
    return f"free:{step.device}"


def step_waits(
    graph: Graph, steps: Sequence[Step], random_ops: Collection[str] = (), lanes: Sequence[str] | None = None
) -> list[tuple[int, ...]]:
    """For each step, the earlier steps on other lanes it waits for, ascending. Of several steps on one lane
    only the latest is kept: a lane finishes its steps in order, so the latest stands for all.

    `lanes` (default lane_of) may put a free on its device's compute lane when everything it waits for is there
    (the executor does, to run such frees inline); "the frees before it" then means the latest on each lane."""
    lanes = list(lanes) if lanes is not None else [lane_of(s) for s in steps]
    made: dict[tuple[str, str], int] = {}  # (value, device) -> the step that put it there
    reads: dict[tuple[str, str], list[int]] = {}
    frees: dict[str, dict[str, int]] = {}  # device -> lane -> its latest free
    computes: dict[str, int] = {}  # device -> its latest compute
    last_draw: int | None = None
    drawn: set[str] = set()
    out: list[tuple[int, ...]] = []
    for i, s in enumerate(steps):
        deps: list[int | None]
        if isinstance(s, Compute):
            op = graph.op[s.op]
            deps = [made.get((v, s.device)) for v in op.inputs] + list(frees.get(s.device, {}).values())
            for v in op.inputs:
                reads.setdefault((v, s.device), []).append(i)
            for v in op.outputs:
                made[(v, s.device)] = i
            computes[s.device] = i
            if op.id in random_ops and op.id not in drawn:
                deps.append(last_draw)
                last_draw = i
                drawn.add(op.id)
        elif isinstance(s, Copy):
            deps = [made.get((s.value, s.src)), computes.get(s.dst), *frees.get(s.dst, {}).values()]
            reads.setdefault((s.value, s.src), []).append(i)
            made[(s.value, s.dst)] = i
        else:
            deps = [made.get((s.value, s.device)), computes.get(s.device), *reads.pop((s.value, s.device), [])]
            frees.setdefault(s.device, {})[lanes[i]] = i
        latest: dict[str, int] = {}
        for j in deps:
            if j is not None and lanes[j] != lanes[i] and latest.get(lanes[j], -1) < j:
                latest[lanes[j]] = j
        out.append(tuple(sorted(latest.values())))
    return out


def inline_free_lanes(graph: Graph, steps: Sequence[Step]) -> list[str]:
    """lane_of for every step, except that a free whose waits are all on its device's compute lane (nothing but
    computes there made or read the value) runs on that compute lane, in plan order: no hand-off to wait for."""
    lanes = [lane_of(s) for s in steps]
    for i, deps in enumerate(step_waits(graph, steps)):
        s = steps[i]
        if isinstance(s, Free) and all(lanes[j] == f"compute:{s.device}" for j in deps):
            lanes[i] = f"compute:{s.device}"
    return lanes


def overlapped_spans(
    steps: Sequence[Step],
    durations: Sequence[float],
    waits: Sequence[Sequence[int]],
    lanes: Sequence[str] | None = None,
) -> list[tuple[float, float]]:
    """(start, end) of each step when every step starts as soon as its lane is free and its waits are over."""
    lane_end: dict[str, float] = {}
    spans: list[tuple[float, float]] = []
    for k, (s, t, deps) in enumerate(zip(steps, durations, waits, strict=True)):
        lane = lanes[k] if lanes is not None else lane_of(s)
        start = max([lane_end.get(lane, 0.0)] + [spans[j][1] for j in deps])
        spans.append((start, start + t))
        lane_end[lane] = start + t
    return spans
