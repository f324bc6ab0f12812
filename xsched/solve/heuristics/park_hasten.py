"""Park's moves on values parked already, for a peak no other move lowers: a park frees its value once its copy out
is done, and where the out lane is busy that is positions after its last read, so a later peak in between (the
logits made at the end of forward) finds the value still here, its span there with no read after the peak (no drop
or park applies). Such a park is waited for there (Hasten) or undone for a drop or an end rerun (Unpark). Also the
test that keeps a drop from pinning an output that leaves for good (pins_leaving)."""

from __future__ import annotations

import bisect
from collections.abc import Mapping
from dataclasses import dataclass, replace

from xsched.solve.heuristics.park_model import EndRerun, Park, ParkTimeline, copy_out_way
from xsched.solve.heuristics.timeline import Drop


@dataclass(frozen=True)
class Hasten:
    """Free `value` (its span `span`, held only for the copy out of park `index` of the timeline's parks) before
    position `q`, the peak, instead of after its copy is done; `stall`: the seconds the compute at `q` waits."""

    value: str
    span: int
    index: int
    q: int
    stall: float

    def score(self, line: ParkTimeline) -> float:
        """Seconds of waiting per byte freed at the peak."""
        return self.stall / line.nbytes[self.value]


def hastens(line: ParkTimeline, t: int) -> list[Hasten]:
    """Every park whose value is resident at `t` only for its copy out: read last before `t`, freed after it."""
    out = []
    for i, pk in enumerate(line.parks):
        if pk.out and pk.read < t < pk.q and line.nbytes[pk.value] > 0 and (h := _hasten(line, i, pk, t)):
            out.append(h)
    return out


def _hasten(line: ParkTimeline, i: int, pk: Park, t: int) -> Hasten | None:
    """Park `i` hastened to `t`, or None where later moves hold its value at `t` for more than the copy: a span
    reaching past the park's free, or a read (a rerun's) at `t` or after it in the span."""
    spans = line.spans[pk.value]
    k = next((k for k, (s, e) in enumerate(spans) if s < t and e == pk.q - 1), None)
    if k is None:
        return None
    uses = line.uses[pk.value]
    j = bisect.bisect_left(uses, t)
    if j < len(uses) and uses[j] < pk.q:
        return None
    way = copy_out_way(pk)
    at = line.lanes[way].items.index(line.copy_out(pk))
    return Hasten(pk.value, k, i, t, max(0.0, line.done[way][at] - line.start_s[t]))


def apply_hasten(line: ParkTimeline, h: Hasten) -> None:
    """Free the value before `h.q`: its span ends there, and its park (and its copy out's due position) says so.
    The copy itself is where it was: no finish time on any lane changes."""
    pk = line.parks[h.index]
    line.spans[h.value][h.span][1] = h.q - 1
    line.mem[h.q : pk.q] -= line.nbytes[h.value]
    lane = line.lanes[copy_out_way(pk)]
    at = lane.items.index(line.copy_out(pk))
    moved = replace(pk, q=h.q, stall=pk.stall + h.stall, cost=pk.cost + h.stall)
    lane.items[at] = line.copy_out(moved)
    line.parks[h.index] = moved


@dataclass(frozen=True)
class Unpark:
    """Park `index` of the timeline's parks undone and its value dropped instead (`move`: freed after its last read
    before the peak `t`, made again before its next read, or at the end for an output parked for good), where the
    park's copy out is not done by the peak."""

    index: int
    move: Drop | EndRerun
    t: int

    def score(self, cost: Mapping[str, float]) -> float:
        """Seconds of reruns per byte freed at the peak, as a drop's or an end rerun's score."""
        m = self.move
        return (sum(cost[p] for p in m.reruns) if isinstance(m, Drop) else cost[m.producer]) / m.freed(self.t)


def unparks(line: ParkTimeline, hs: list[Hasten], budget: int, depth: int) -> list[Unpark]:
    """For each hastened park whose copy on the store no other park reuses, the drop (or, parked for good, the end
    rerun) that replaces it, where that lowers the peak: a rerun of a cheap producer (the attention's softmax on
    the H100: 0.2 ms) instead of waiting for its copy out (384 MiB: 6.6 ms on the host link), or the logits' matmul
    at the end (12.5 ms) instead of their 30 ms copy out."""
    out = []
    for h in hs:
        pk = line.parks[h.index]
        if not _undoable(line, pk):
            continue
        saved = _save(line, pk.value)
        _undo(line, h.index)
        k = next(k for k, (s, e) in enumerate(line.spans[pk.value]) if s < h.q <= e)
        if pk.b is None:
            m = line.end_rerun(pk.value, k, h.q, budget)
        else:
            m = line.drop(pk.value, k, h.q, budget, depth)  # (one pinning a leaving output is kept here: the
            # peaks it would pin are lowered by this fallback in turn, and on GPT-2 at 25% the plans are faster)
        _restore(line, pk.value, saved)
        if m is not None:
            out.append(Unpark(h.index, m, h.q))
    return out


def apply_unpark(line: ParkTimeline, u: Unpark) -> None:
    """Undo the park and apply its drop or end rerun in its place."""
    _undo(line, u.index)
    if isinstance(u.move, Drop):
        line.apply(u.move)
    else:
        line.apply_end(u.move)
    line.refresh()


def pins_leaving(line: ParkTimeline, d: Drop) -> bool:
    """A rerun of `d` reads an output that may leave the device for good after its last read: the timeline holds
    that output to the end until it leaves, so reading it later looks free, but it pins the output here through
    the rerun, over peaks that only its leaving can lower (the chunked loss's logits, 1.53 GiB on GPT-2, read
    again by a rerun log_softmax, stay over every chunk's backward: no plan at 25% with the store)."""
    for p in d.reruns:
        for u in line.graph.op[p].inputs:
            if u in line.may_leave and line.uses[u] and d.b > line.uses[u][-1]:
                return True
    return False


def _undoable(line: ParkTimeline, pk: Park) -> bool:
    """`pk` is its value's only park, to the store, the store's copy its own; back before a read (its copy back on
    the in lane as queued), or for good an output with no home to reach (no copy home to queue again) that no end
    rerun reads."""
    v = pk.value
    if pk.to is not None or sum(o.value == v for o in line.parks) > 1 or line.stored_from.get(v) != pk.a:
        return False
    if pk.b is None:
        value = line.graph.value[v]
        return value.grad_of is None and value.updates is None and v not in line.end_reads
    return v not in line.may_leave and _after(line, pk) is not None


def _after(line: ParkTimeline, pk: Park) -> int | None:
    """The index of `pk`'s value's span that its copy back starts, None where later moves left none, or its copy
    back is not on the in lane as the park queued it."""
    n = line.nbytes[pk.value]
    if (pk.p, pk.p, line.seconds("in", n), pk.b) not in line.lanes["in"].items:
        return None
    return next((j for j, (s, _) in enumerate(line.spans[pk.value]) if s == pk.p), None)


def _undo(line: ParkTimeline, i: int) -> None:
    """Take park `i` (`_undoable`) out of the timeline: its copies leave their lanes and its value is resident
    through its gap again (for good: to the end, as an output is held)."""
    pk = line.parks[i]
    v, n = pk.value, line.nbytes[pk.value]
    spans = line.spans[v]
    k = next(k for k, (_, e) in enumerate(spans) if e == pk.q - 1)
    if pk.b is None:
        spans[k][1] = len(line.ops) - 1
        line.ended.discard(v)
    else:
        after = _after(line, pk)
        spans[k : after + 1] = [[spans[k][0], spans[after][1]]]
        line.lanes["in"].remove((pk.p, pk.p, line.seconds("in", n), pk.b))
    del line.parks[i]
    line.mem[pk.q : pk.p] += n
    line.lanes["out"].remove(line.copy_out(pk))
    del line.stored_from[v]
    for way in ("out", "in"):
        line.done[way] = line.lanes[way].finishes(line.start_s)


def _save(line: ParkTimeline, v: str) -> tuple:
    """What _undo changes, to put back after a trial."""
    lanes = {w: (list(line.lanes[w].items), list(line.lanes[w].emits)) for w in ("out", "in")}
    spans = [list(s) for s in line.spans[v]]
    return spans, line.mem.copy(), lanes, dict(line.done), line.stored_from[v], list(line.parks), set(line.ended)


def _restore(line: ParkTimeline, v: str, saved: tuple) -> None:
    """Put back what _save saved."""
    spans, mem, lanes, done, stored, parks, ended = saved
    line.spans[v], line.done, line.parks, line.stored_from[v], line.ended = spans, done, parks, stored, ended
    line.mem[:] = mem
    for w, (items, emits) in lanes.items():
        line.lanes[w].items, line.lanes[w].emits = items, emits
