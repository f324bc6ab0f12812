"""Park's move on a value parked already: free it sooner, the compute at the peak waiting for its copy out. A park
frees its value once its copy out is done; where the out lane is busy that is positions after its last read, and a
later peak in between (the logits made at the end of forward) finds the value still here, with no other move
left on it: its span there has no read after the peak, so neither a drop nor a park applies."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, replace

from xsched.solve.heuristics.park_model import Park, ParkTimeline, _way


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
    way = _way(pk)
    at = line.lanes[way].items.index(line._copy_out(pk))
    return Hasten(pk.value, k, i, t, max(0.0, line.done[way][at] - line.start_s[t]))


def apply_hasten(line: ParkTimeline, h: Hasten) -> None:
    """Free the value before `h.q`: its span ends there, and its park (and its copy out's due position) says so.
    The copy itself is where it was: no finish time on any lane changes."""
    pk = line.parks[h.index]
    line.spans[h.value][h.span][1] = h.q - 1
    line.mem[h.q : pk.q] -= line.nbytes[h.value]
    lane = line.lanes[_way(pk)]
    at = lane.items.index(line._copy_out(pk))
    moved = replace(pk, q=h.q, stall=pk.stall + h.stall, cost=pk.cost + h.stall)
    lane.items[at] = line._copy_out(moved)
    line.parks[h.index] = moved
