"""Park's timeline made into plan steps: its copies out and back, reruns and computes per position, routed, and
each parked value's free moved to where the timeline has it off the compute device (`park.line_plan`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from xsched.contracts.graph import Graph
from xsched.contracts.plan import Compute, Copy, Free, Step, required_homes
from xsched.contracts.profile import Profile
from xsched.solve.autograd_boundary import hold_to_boundary
from xsched.solve.heuristics.park_model import Park, ParkTimeline
from xsched.solve.heuristics.routing import route


def park_steps(graph: Graph, line: ParkTimeline, homes: Mapping[str, str], profile: Profile) -> tuple[Step, ...]:
    """The timeline as plan steps: per position its copies back and first fetches, its reruns, its compute and the
    copies out after it (the end's reruns last), routed (the copies the computes still need, frees after last
    reads; the copies home at the end, where line_plan issues them early); then each parked value's free moved from right after its copy out to the first step of the position
    where the timeline has it off the device, so the computes in between need not wait for the copy (a value
    parked for good, which placing frees keeps to the end, gets its free there)."""
    parks = _kept_parks(line)
    backs: dict[int, list[Copy]] = {}
    outs: dict[int, list[Copy]] = {}
    # id of a copy out -> (residency, position of its last read before the gap, position to free it at)
    move: dict[int, tuple[tuple[str, str], int, int]] = {}
    direct: list[tuple[tuple[str, str], int]] = []  # parked for good, on the store already: freed at a position
    for pk, free_at, back_at in parks:
        if back_at < len(line.ops):
            backs.setdefault(back_at, []).append(Copy(pk.value, line.store, line.device))
        if pk.out:
            out = Copy(pk.value, line.device, pk.to or line.store)
            outs.setdefault(pk.a, []).append(out)
            move[id(out)] = ((pk.value, line.device), pk.read, free_at)
        elif pk.b is None:
            direct.append(((pk.value, line.device), free_at))
    for v, p0 in line.fetch.items():  # first fetches of inputs homed on the store, ahead of their first reader
        backs.setdefault(p0, []).append(Copy(v, line.store, line.device))
    main: list[Compute] = []
    plan: list[Compute | Copy] = []
    for t, op in enumerate(line.ops):
        plan += backs.get(t, [])
        plan += [Compute(p, line.device) for p in line.reruns_at(t)]
        main.append(Compute(op.id, line.device))
        plan.append(main[-1])
        plan += outs.get(t, [])
    plan += [Compute(p, line.device) for p in line.end_redo]
    plan += _home_from_store(graph, line, parks, homes)
    # an output whose home this device has no link to goes through the store (park_model allows it only if linked)
    steps = route(graph, plan, homes, profile, via=(line.store,))
    for_good = {pk.value for pk, _, _ in parks if pk.b is None}
    steps = _frees_moved(graph, steps, _group_starts(steps, main, set(move)), move, direct, for_good)
    # a forward output made again at the end keeps its first residency to the boundary, where wrap returns it
    return tuple(hold_to_boundary(graph, steps))


def _home_from_store(
    graph: Graph, line: ParkTimeline, parks: list[tuple[Park, int, int]], homes: Mapping[str, str]
) -> list[Copy]:
    """The copies home, from the store at the end, of the values parked for good there that must end on a third
    device: routing would send them from any device that held them, the compute device included, whose copy the
    park frees at its gap (one parked straight home needs none)."""
    must_end = required_homes(graph, homes)
    return [
        Copy(pk.value, line.store, must_end[pk.value])
        for pk, _, _ in parks
        if pk.b is None and pk.to is None and must_end.get(pk.value, line.store) != line.store
    ]


def _kept_parks(line: ParkTimeline) -> list[tuple[Park, int, int]]:
    """Each park with the positions its value is off the compute device by the final spans (a later rerun may hold
    it longer, or make it again), none of a value any of whose parks no longer holds."""
    kept: list[tuple[Park, int, int]] = []
    drop: set[str] = set()
    for pk in line.parks:
        window = _window(line, pk.value, pk)
        producer = line.graph.producer.get(pk.value)
        rerun = window is not None and any(
            producer in line.redo.get(x, ()) for x in range(window[0], min(window[1] + 1, len(line.ops)))
        )
        if window is None or rerun or (pk.b is None and producer in line.end_redo):
            drop.add(pk.value)
        else:
            kept.append((pk, *window))
    return [k for k in kept if k[0].value not in drop]


def _frees_moved(graph: Graph, steps, group, move, direct, for_good: set[str]) -> tuple[Step, ...]:
    """Each free that ends a residency copied out in `move`, after its last read before its gap (an earlier free is
    another gap's, of a value parked there again), held back to the first step of its free position; a value
    parked for good (`for_good`, `direct`) freed there when placing frees kept it to the end. A held free goes at
    once where a step would make the value there again (a rerun of its producer for another of its outputs)."""
    held: dict[tuple[str, str], int] = {}  # residency -> the step index to free it before
    moved: set[tuple[str, str]] = set()  # of those, the frees held back past where placing frees put them
    for key, at in direct:
        held[key] = group[at]
    pending: dict[tuple[str, str], tuple[int, int]] = {}  # residency copied out -> (its last read's, its free's)
    out: list[Step] = []
    for i, s in enumerate(steps):
        makes = _made_here(graph, s)
        for key in [k for k, at in held.items() if at <= i or (k in moved and k in makes)]:
            out.append(Free(*key))
            del held[key]
            moved.discard(key)
        if id(s) in move:
            key, read, at = move[id(s)]
            pending[key] = (group[read], group[at])
            if key[0] in for_good:
                held[key] = group[at]
        key = (s.value, s.device) if isinstance(s, Free) else None
        if key in pending and pending[key][0] <= i:
            at = pending.pop(key)[1]
            if at > i:  # else its position has begun already: it stays where it is
                held[key] = at
                moved.add(key)
                continue
        if key in held:  # placing frees freed it itself (a value parked for good, made again and freed)
            del held[key]
            moved.discard(key)
        out.append(s)
    return (*out, *(Free(*key) for key in held))


def _made_here(graph: Graph, s: Step) -> set[tuple[str, str]]:
    """The residencies a step makes: a compute's outputs on its device, a copy's value on its destination."""
    if isinstance(s, Compute):
        return {(v, s.device) for v in graph.op[s.op].outputs}
    return {(s.value, s.dst)} if isinstance(s, Copy) else set()


def _group_starts(steps: Sequence[Step], main: Sequence[Compute], outs: set[int]) -> list[int]:
    """For each position, the index of its first step: what follows the previous position's compute, the copies out
    after it (`outs`: their ids) and frees."""
    ids = {id(c): t for t, c in enumerate(main)}
    starts, t_prev = [0], 0
    for i, s in enumerate(steps):
        if len(starts) <= t_prev and not isinstance(s, Free) and id(s) not in outs:
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
