"""The overlapped execution model: the lane that runs each plan step, the earlier steps each waits for, and
the overlapped times that follow. The simulator's makespan and the executor's waits both come from here.

Lanes: one compute lane per device, one copy lane per ordered device pair, one free lane per device. A lane
runs its steps in plan order. Across lanes a step waits for
- a compute: the steps that made its inputs on its device, and the frees before it on its device (so an
  overlapped run never needs more memory than the plan frees);
- a copy: the step that made the value on the source, and the frees before it on the destination;
- a free: the step that made the value on its device and every read of it there;
- a random op's first run: the previous random op's first run, so draws happen in plan order, as eager
  PyTorch makes them (the RNG is shared by every lane).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from xsched.graph import Graph
from xsched.plan import Compute, Copy, Step


def lane_of(step: Step) -> str:
    if isinstance(step, Compute):
        return f"compute:{step.device}"
    if isinstance(step, Copy):
        return f"copy:{step.src}->{step.dst}"
    return f"free:{step.device}"


def step_waits(graph: Graph, steps: Sequence[Step], random_ops: Collection[str] = ()) -> list[tuple[int, ...]]:
    """For each step, the earlier steps on other lanes it waits for, ascending. Of several steps on one lane
    only the latest is kept: a lane finishes its steps in order, so the latest stands for all."""
    lanes = [lane_of(s) for s in steps]
    made: dict[tuple[str, str], int] = {}  # (value, device) -> the step that put it there
    reads: dict[tuple[str, str], list[int]] = {}
    last_free: dict[str, int] = {}
    last_draw: int | None = None
    drawn: set[str] = set()
    out: list[tuple[int, ...]] = []
    for i, s in enumerate(steps):
        deps: list[int | None]
        if isinstance(s, Compute):
            op = graph.op[s.op]
            deps = [made.get((v, s.device)) for v in op.inputs] + [last_free.get(s.device)]
            for v in op.inputs:
                reads.setdefault((v, s.device), []).append(i)
            for v in op.outputs:
                made[(v, s.device)] = i
            if op.id in random_ops and op.id not in drawn:
                deps.append(last_draw)
                last_draw = i
                drawn.add(op.id)
        elif isinstance(s, Copy):
            deps = [made.get((s.value, s.src)), last_free.get(s.dst)]
            reads.setdefault((s.value, s.src), []).append(i)
            made[(s.value, s.dst)] = i
        else:
            deps = [made.get((s.value, s.device)), *reads.pop((s.value, s.device), [])]
            last_free[s.device] = i
        latest: dict[str, int] = {}
        for j in deps:
            if j is not None and lanes[j] != lanes[i] and latest.get(lanes[j], -1) < j:
                latest[lanes[j]] = j
        out.append(tuple(sorted(latest.values())))
    return out


def overlapped_spans(
    steps: Sequence[Step], durations: Sequence[float], waits: Sequence[Sequence[int]]
) -> list[tuple[float, float]]:
    """(start, end) of each step when every step starts as soon as its lane is free and its waits are over."""
    lane_end: dict[str, float] = {}
    spans: list[tuple[float, float]] = []
    for s, t, deps in zip(steps, durations, waits, strict=True):
        lane = lane_of(s)
        start = max([lane_end.get(lane, 0.0)] + [spans[j][1] for j in deps])
        spans.append((start, start + t))
        lane_end[lane] = start + t
    return spans
