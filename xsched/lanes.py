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
Of those, a step keeps only the waits that no other of its waits, nor the step before it on its lane, implies
(reduce_waits): the executor's lanes then hand off only where they must, and a free whose remaining waits are all
on its device's compute lane runs there (inline_free_lanes).
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Sequence

from xsched.contracts.graph import Graph
from xsched.contracts.plan import Compute, Copy, Free, Step

# who issues an overlapped run's steps onto their lanes: a thread per lane, or the calling thread alone (the executor)
ISSUE_MODES = ("lanes", "one")


def lane_of(step: Step) -> str:
    if isinstance(step, Compute):
        return f"compute:{step.device}"
    if isinstance(step, Copy):
        return f"copy:{step.src}->{step.dst}"
    return f"free:{step.device}"


def step_waits(
    graph: Graph, steps: Sequence[Step], random_ops: Collection[str] = (), lanes: Sequence[str] | None = None
) -> list[tuple[int, ...]]:
    """For each step, the earlier steps on other lanes it waits for, ascending: direct_waits less every wait another
    one implies (reduce_waits), so a free of a copied-in value waits for its reads, not for the copy they waited for.

    `lanes` (default lane_of) may put a free on its device's compute lane when everything it waits for is there
    (the executor does, to run such frees inline); "the frees before it" then means the latest on each lane."""
    lanes = list(lanes) if lanes is not None else [lane_of(s) for s in steps]
    return reduce_waits(direct_waits(graph, steps, random_ops, lanes), lanes)


def direct_waits(
    graph: Graph, steps: Sequence[Step], random_ops: Collection[str] = (), lanes: Sequence[str] | None = None
) -> list[tuple[int, ...]]:
    """For each step, the earlier steps on other lanes the rules above make it wait for, ascending. Of several
    steps on one lane only the latest is kept: a lane finishes its steps in order, so the latest stands for all."""
    lanes = list(lanes) if lanes is not None else [lane_of(s) for s in steps]
    return [_latest(deps, lanes, lanes[i]) for i, deps in enumerate(_rule_waits(graph, steps, random_ops, lanes))]


def _rule_waits(
    graph: Graph, steps: Sequence[Step], random_ops: Collection[str], lanes: list[str]
) -> Iterator[list[int | None]]:
    """Each step's waits by the rules, any lane, None where there is none. A generator: the caller may still set
    lanes[i] after step i's are yielded (inline_free_lanes does), before they count for later steps."""
    made: dict[tuple[str, str], int] = {}  # (value, device) -> the step that put it there
    reads: dict[tuple[str, str], list[int]] = {}
    frees: dict[str, dict[str, int]] = {}  # device -> lane -> its latest free
    computes: dict[str, int] = {}  # device -> its latest compute
    last_draw: int | None = None
    drawn: set[str] = set()
    for i, s in enumerate(steps):
        if isinstance(s, Compute):
            op = graph.op[s.op]
            deps = [made.get((v, s.device)) for v in op.inputs] + list(frees.get(s.device, {}).values())
            if op.id in random_ops and op.id not in drawn:
                deps.append(last_draw)
                last_draw = i
                drawn.add(op.id)
            yield deps
            for v in op.inputs:
                reads.setdefault((v, s.device), []).append(i)
            for v in op.outputs:
                made[(v, s.device)] = i
            computes[s.device] = i
        elif isinstance(s, Copy):
            yield [made.get((s.value, s.src)), computes.get(s.dst), *frees.get(s.dst, {}).values()]
            reads.setdefault((s.value, s.src), []).append(i)
            made[(s.value, s.dst)] = i
        else:
            yield [made.get((s.value, s.device)), computes.get(s.device), *reads.pop((s.value, s.device), [])]
            frees.setdefault(s.device, {})[lanes[i]] = i


def _latest(deps: Sequence[int | None], lanes: Sequence[str], own: str) -> tuple[int, ...]:
    """The latest of `deps` on each lane other than `own`, ascending."""
    latest: dict[str, int] = {}
    for j in deps:
        if j is not None and lanes[j] != own and latest.get(lanes[j], -1) < j:
            latest[lanes[j]] = j
    return tuple(sorted(latest.values()))


class _Clocks:
    """Vector clocks: per step, lane -> the latest step there known complete once it completes (a lane completes
    its steps in order, and a step completes after all it waited for); per lane, its latest step's."""

    def __init__(self) -> None:
        self.of: list[dict[str, int]] = []
        self.lane: dict[str, dict[str, int]] = {}

    def kept(self, deps: Sequence[int], lane: str, lanes: Sequence[str]) -> tuple[int, ...]:
        """`deps` less those another of them, or the step before on `lane`, waited for (or a later step on theirs)."""
        before, of = self.lane.get(lane, {}), self.of
        return tuple(
            j
            for j in deps
            if before.get(lanes[j], -1) < j and not any(k != j and of[k].get(lanes[j], -1) >= j for k in deps)
        )

    def add(self, i: int, waits: Sequence[int], lane: str) -> None:
        clock = dict(self.lane.get(lane, {}))
        for j in waits:
            for other, k in self.of[j].items():
                if clock.get(other, -1) < k:
                    clock[other] = k
        clock[lane] = i
        self.of.append(clock)
        self.lane[lane] = clock


def reduce_waits(waits: Sequence[Sequence[int]], lanes: Sequence[str]) -> list[tuple[int, ...]]:
    """`waits` less every wait that another of the step's waits, or the step before it on its lane, already implies
    (it waited for that step or a later one on its lane, directly or through others): the transitive reduction, in
    O(steps x lanes) with a vector clock per step. No overlapped start moves (overlapped_spans): the implying step
    ends no earlier than the one it implies."""
    clocks = _Clocks()
    out: list[tuple[int, ...]] = []
    for i, deps in enumerate(waits):
        out.append(clocks.kept(deps, lanes[i], lanes))
        clocks.add(i, out[-1], lanes[i])  # the kept waits imply the dropped ones: their clocks hold them
    return out


def inline_free_lanes(graph: Graph, steps: Sequence[Step], random_ops: Collection[str] = ()) -> list[str]:
    """lane_of for every step, except that a free with nothing left to wait for off its device's compute lane, once
    there (its reads and the computes before it imply the rest: a copied-in value's copy), runs on that lane, in
    plan order: no hand-off to wait for. Decided in plan order on the lanes decided so far, so step_waits on the
    result leaves such a free no wait (a wait the free lane's order implied does not count there)."""
    lanes = [lane_of(s) for s in steps]
    clocks = _Clocks()
    for i, deps in enumerate(_rule_waits(graph, steps, random_ops, lanes)):
        s = steps[i]
        if isinstance(s, Free):
            home = f"compute:{s.device}"
            if not clocks.kept(_latest(deps, lanes, home), home, lanes):
                lanes[i] = home
        clocks.add(i, clocks.kept(_latest(deps, lanes, lanes[i]), lanes[i], lanes), lanes[i])
    return lanes


def timed_spans(
    graph: Graph, steps: Sequence[Step], durations: Sequence[float], random_ops: Collection[str] = ()
) -> list[tuple[float, float]]:
    """overlapped_spans of `steps` on their lanes (lane_of), from the rules' waits as they come: a wait that
    direct_waits or reduce_waits drops is implied by one they keep (a later step on its lane, the step before on
    the step's own lane, or a step that waited for it), which ends no earlier, so it moves no start: the spans
    equal those of step_waits, without the cost of reducing (the simulator times every plan a search tries)."""
    lanes = [lane_of(s) for s in steps]
    waits = [[j for j in deps if j is not None] for deps in _rule_waits(graph, steps, random_ops, lanes)]
    return overlapped_spans(steps, durations, waits, lanes)


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
