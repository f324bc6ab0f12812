"""The timeline `park_remat` decides on: the heuristics' one timeline of a compute device's order, reruns included
(`timeline.Timeline`), plus a store and its two copy lanes, and a lane to each third device that a value made here
must end on (a gradient whose parameter lives there may go straight home). A lane runs its copies one after another
in plan order, as the executor's copy streams do (`xsched.lanes`), at the positions' ideal start times (each
position's computes, reruns included, back to back): a park's cost is the time its copies would keep a compute
waiting, its own and what it adds to the copies queued behind it. The out lane also carries the copies home of the
outputs that must end on the store, each issued once its value is made (`park.park_steps`)."""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np

from xsched.contracts.graph import Graph
from xsched.contracts.plan import required_homes
from xsched.contracts.profile import LinkCost, Profile
from xsched.solve.heuristics.park_lane import Lane
from xsched.solve.heuristics.timeline import Timeline, op_seconds


@dataclass(frozen=True)
class EndRerun:
    """Free output `value` before position `free_from` and run `producer` again after the last position, holding
    the inputs `extend` ((value, span index)) to the end; `delta`: the change in bytes from position `lo` on."""

    value: str
    span: int
    free_from: int
    extend: tuple[tuple[str, int], ...]
    producer: str
    lo: int
    delta: np.ndarray

    def freed(self, t: int) -> np.int64:
        """The bytes the rerun at the end frees at position `t`."""
        return -self.delta[t - self.lo]


@dataclass(frozen=True)
class Park:
    """Park `value` across a gap of its span `span`: copied out after position a, where the span starts (unless the
    store holds a copy made by then, or an earlier gap's park made later copies out first), freed before position q
    (after its last read before the gap), copied back before position p for its next read at b (None: it stays on
    the store to the end, or on its home `to`, copied there instead); resident on the compute device through q - 1
    and again from p. `cost`: the seconds its copies keep computes waiting, plus the link's price."""

    value: str
    span: int
    a: int
    q: int
    p: int
    b: int | None
    out: bool
    cost: float
    stall: float
    read: int  # its last read before the gap (its position): what it is freed after
    # parked for good straight onto its home, a third device (ParkTimeline.direct); None: the store
    to: str | None = None


class ParkTimeline(Timeline):
    """The timeline of one compute device, reruns included, with a store and the two copy lanes between them."""

    def __init__(
        self,
        graph: Graph,
        order: Sequence[int],
        device: str,
        profile: Profile,
        store: str,
        out: LinkCost,
        back: LinkCost,
        homes: Mapping[str, str],
    ) -> None:
        super().__init__(graph, [graph.ops[i] for i in order], device, profile)
        self.store, self.links = store, {"out": out, "in": back}
        self.op_s = op_seconds(graph, device, profile, untimed=0.0)
        self.lanes = {"out": Lane([]), "in": Lane([])}
        self.outputs = frozenset(graph.outputs)  # end_rerun asks for every candidate: a set, not the tuple
        self._ready: tuple | None = None  # _in_ready's arrays and the lane finish times and starts they are of
        # values that may be parked: made by an op, or graph inputs not homed on the compute device; an output that
        # need not end here may also go to the store for good (after the autograd boundary, where wrap returns it;
        # one that must end on a third device is copied there from the store at the end: park.park_steps)
        self.homed_here = {v for v, d in homes.items() if d == device}
        must_end = required_homes(graph, homes)
        # (never one the caller holds: it stays on the device it is on at the boundary; nor one that must end on a
        # third device linked neither from the store nor from this one)
        self.may_leave = {
            v
            for v in graph.outputs
            if (h := must_end.get(v, store)) != device
            and v in graph.producer
            and v not in self.held
            and (h == store or profile.link(store, h) or profile.link(device, h))
        }
        # those that must end on a third device linked from this one (a gradient whose parameter lives there) may
        # instead go straight home for good, on a lane of its own: one copy, not two via the store
        self.direct = {
            v: h for v in self.may_leave if (h := must_end.get(v, store)) != store and profile.link(device, h)
        }
        self.direct_only = {v for v, h in self.direct.items() if not profile.link(store, h)}  # no way on from the store
        for h in set(self.direct.values()):
            self.links[_to(h)] = profile.link(device, h)
            self.lanes[_to(h)] = Lane([])
        # value -> the first position after whose compute the store holds it (-1: homed there): a gap before that
        # has no copy on the store to come back from, even where a later gap of the value was parked already
        self.stored_from: dict[str, int] = {v: -1 for v, d in homes.items() if d == store}
        self.parks: list[Park] = []
        self.ended: set[str] = set()  # outputs made again at the end, or parked for good
        self.end_redo: list[str] = []  # their producers, run after the last position
        self.end_reads: set[str] = set()  # the inputs those reruns read at the end: never parked for good
        self.copied_in = self._inputs_from_first_read(homes)
        self.home_out: dict[str, tuple[int, int, float, int]] = {}  # (filled below, once the fetches are queued)
        self.refresh()
        self.fetch = self._fetch_store_inputs()
        # output held here to the end that must end on the store -> its copy there, issued once it is made
        # (routing.home_copies_early), on the out lane: each park's stall counts the lane's time they take
        self.home_out = {v: self._home_item(v) for v in sorted(self.may_leave) if must_end.get(v) == self.store}
        for item in self.home_out.values():
            self.lanes["out"].add(item)
        self.refresh()

    def _inputs_from_first_read(self, homes: Mapping[str, str]) -> set[str]:
        """Graph inputs homed off the compute device are not held here from the start (Timeline's default): one never
        read here is never copied here at all, and one homed on a third device is resident only from its first read
        (routing copies it in right before its reader) to its last (an output: to the end, where routing keeps it).
        Those on the store get their spans from `_fetch_store_inputs`; the third device's: the inputs returned."""
        n, third = len(self.ops), set()
        for v in self.graph.inputs:
            if homes.get(v, self.device) == self.device:
                continue  # (an input with no home: left as Timeline counts it, held from the start)
            s, e = self.spans[v][0]
            self.mem[s : e + 1] -= self.nbytes[v]
            if not self.uses[v]:
                self.spans[v] = []
            elif homes[v] != self.store:
                first, last = self.uses[v][0], (n - 1 if v in self.graph.outputs else self.uses[v][-1])
                self.spans[v] = [[first, last]]
                self.mem[first : last + 1] += self.nbytes[v]
                third.add(v)
        return third

    def _fetch_store_inputs(self) -> dict[str, int]:
        """Inputs homed on the store (weights kept on the host) are resident here only from their first fetch,
        queued on the in lane to be done by their first reader, to their last read: input -> fetch position."""
        fetch: dict[str, int] = {}
        n = len(self.ops)
        homed = [v for v, at in self.stored_from.items() if at < 0 and v in self.graph.value and self.uses[v]]
        for v in sorted(homed, key=lambda v: (self.uses[v][0], v)):  # by name on a tie: not by hash order
            first, last = self.uses[v][0], (n - 1 if v in self.graph.outputs else self.uses[v][-1])
            secs = self.seconds("in", self.nbytes[v])
            p, _, _, _ = self._back(-1, first, secs)
            # a fetch moves no compute: only its lane's finish times change
            self.done["in"] = self.lanes["in"].added(self.start_s, self.done["in"], (p, p, secs, first))
            self.spans[v] = [[p, last]]
            self.mem[p : last + 1] += self.nbytes[v]  # (_inputs_from_first_read took out its bytes)
            fetch[v] = p
        return fetch

    @property
    def untouched(self) -> bool:
        """No park, rerun or end rerun made: the order fits as it is (its inputs homed on the store fetched)."""
        return not self.parks and not any(self.redo.values()) and not self.end_redo

    def refresh(self) -> None:
        """The positions' start times (reruns included) and the lanes' finish times, after a move."""
        for v, item in self.home_out.items():
            if item != (moved := self._home_item(v)):
                self.lanes["out"].remove(item)
                self.home_out[v] = moved
                self.lanes["out"].add(moved)
        dur = [self.op_s[op.id] for op in self.ops]
        for t, redo in self.redo.items():  # (a position with no rerun adds nothing: the sum is 0 there)
            dur[t] = dur[t] + sum(self.op_s[p] for p in set(redo))
        self.start = np.concatenate(([0.0], np.cumsum(dur)))
        # the same times as Python floats, for the loops and bisections that read them one at a time (an array's
        # items are slow to read one by one; the values are the same doubles, ascending: no op takes negative time)
        self.start_s: list[float] = self.start.tolist()
        self.done = {way: lane.finishes(self.start_s) for way, lane in self.lanes.items()}

    def _home_item(self, v: str) -> tuple[int, int, float, int]:
        """`v`'s copy home as the out lane holds it: after its last making, due by the end."""
        a = self.spans[v][-1][0] if self.spans[v] else len(self.ops) - 1
        return (a, a + 1, self.seconds("out", self.nbytes[v]), len(self.ops))

    def seconds(self, way: str, n: int) -> float:
        link = self.links[way]
        return link.latency_s + n / link.bytes_per_s

    def parkable(self, v: str) -> bool:
        """`v` may be parked at all: made by an op, or an input homed off this device or fetched from the store,
        never one homed here or gone from here for good."""
        free = v not in self.fixed or v in self.may_leave or v in self.fetch
        return free and v not in self.homed_here and v not in self.ended

    def ends_again(self, v: str) -> bool:
        """`v` may be made again at the end (end_rerun): an output with a producer, not gone for good, not held."""
        return v in self.outputs and v in self.graph.producer and v not in self.ended and v not in self.held

    def park(self, v: str, k: int, t: int, price: float) -> Park | None:
        """Parking span `k` of `v` across the gap around the peak `t`, or None when that cannot lower `t`."""
        if not self.parkable(v):
            return None
        gap = self.gap(v, k, t)
        if gap is None:
            return None
        (a, b), s = gap, self.spans[v][k][0]
        if v in self.held and (b is None or b > self.boundary):
            return None  # off the device at the boundary, where the caller's hold pins it on the store instead
        if b is None and (v not in self.may_leave or v in self.end_reads or (self.uses[v] and self.uses[v][-1] > t)):
            return None  # for good only after its last read of all (an end rerun's included), where it may leave
        # freed after its last read before the gap (an output parked for good: after the autograd boundary too)
        free_from = a + 1 if b is not None else max(a, self.boundary) + 1
        if free_from > t:
            return None
        n, stall, link_s, q = self.nbytes[v], 0.0, 0.0, free_from
        out = self.stored_from.get(v, len(self.ops)) > s  # no copy made by the span's start: it makes one
        if out and v in self.home_out:  # its copy home, queued already, is the one: freed once that is done
            q, stall, link_s = self._home_done(v, free_from, t)
        elif out:  # queued on the out lane once made; freed once done (the compute at t waits for it, at the latest)
            q, stall, link_s = self._leave("out", s, n, free_from, t)
        if b is None and v in self.direct:  # for good: straight home instead, where that frees the device sooner
            home = self.direct[v]
            q_h, stall_h, link_h = self._leave(_to(home), s, n, free_from, t)
            if v in self.direct_only or (stall_h + price * link_h, q_h) < (stall + price * link_s, q):
                return Park(
                    v, k, s, q_h, len(self.ops), None, True, stall_h + price * link_h, stall_h, free_from - 1, home
                )
        p = len(self.ops)
        if b is not None:  # back on the in lane, from the latest position that lets it be done before b
            secs = self.seconds("in", n)
            p, late, at, finish = self._back(t, b, secs)
            stall += late + self.lanes["in"].delay(self.start_s, self.done["in"], at, finish)
            link_s += secs
        return Park(v, k, s, q, p, b, out, stall + price * link_s, stall, free_from - 1)

    def _leave(self, way: str, s: int, n: int, free_from: int, t: int) -> tuple[int, float, float]:
        """A copy of `n` bytes made at position `s` on lane `way`, queued there once made, the value freed once it is
        done: the position it is freed before (the peak `t` at the latest), the stall it causes (the compute at `t`
        waiting for it, and the copies it delays behind it) and its link seconds."""
        secs = self.seconds(way, n)
        lane, done = self.lanes[way], self.done[way]
        at = lane.slot(s)
        finish = max(self.start_s[s + 1], done[at - 1] if at else 0.0) + secs
        q, stall = max(free_from, bisect.bisect_left(self.start_s, finish - 1e-15)), 0.0
        if q > t:
            stall, q = finish - self.start_s[t], t
        return q, stall + lane.delay(self.start_s, done, at, finish), secs

    def _home_done(self, v: str, free_from: int, t: int) -> tuple[int, float, float]:
        """_leave for a value whose copy home is on the out lane already: moving the lane nothing, freed once done."""
        item, lane = self.home_out[v], self.lanes["out"]
        at = bisect.bisect_left(lane.emits, item[0])
        finish = self.done["out"][lane.items.index(item, at)]
        q = max(free_from, bisect.bisect_left(self.start_s, finish - 1e-15))
        return (t, finish - self.start_s[t], item[2]) if q > t else (q, 0.0, item[2])

    def leave_seconds(self, v: str) -> float:
        """The link seconds of `v`'s cheapest copy off the device: to the store, or straight home (`direct`)."""
        n = self.nbytes[v]
        return min(self.seconds(w, n) for w in ("out", *((_to(self.direct[v]),) if v in self.direct else ())))

    def _back(self, t: int, b: int, secs: float) -> tuple[int, float, int, float]:
        """The copy back's position p in (t, b): the latest whose start lets it be done by b's (t + 1 when none
        does), its lateness, its index on the in lane, and when it is done."""
        ready, at = self._in_ready()
        due = self.start_s[b]
        lo, hi = t + 1, b - 1
        if hi < lo or ready[lo] + secs > due:  # none in time: as early as it may, and late
            f = ready[lo] + secs
            return lo, max(0.0, f - due), at[lo], f
        # ready + secs grows with p: the largest p still in time, found on `ready` and checked in the exact sums
        p = min(hi, max(lo, bisect.bisect_right(ready, due - secs) - 1))
        while p < hi and ready[p + 1] + secs <= due:
            p += 1
        while p > lo and ready[p] + secs > due:
            p -= 1
        return p, 0.0, at[p], ready[p] + secs

    def _in_ready(self) -> tuple[list[float], list[int]]:
        """For each position p: when a copy back emitted there could start (its start, or when the in lane's copies
        emitted at or before p are done), and its index on the in lane; kept until the lane or the starts change
        (every candidate park of one greedy step asks it). As Python lists: each candidate reads a few items, and
        bisects them (both ascending: the starts and the lane's finish times only grow)."""
        done, start = self.done["in"], self.start
        if self._ready is None or self._ready[0] is not done or self._ready[1] is not start:
            at = np.searchsorted(np.asarray(self.lanes["in"].emits, dtype=np.int64), np.arange(len(start)), "right")
            before = np.concatenate(([0.0], np.asarray(done, dtype=np.float64)))[at]
            self._ready = (done, start, np.maximum(start, before).tolist(), at.tolist())
        return self._ready[2], self._ready[3]

    def apply_park(self, pk: Park) -> None:
        s, e = self.spans[pk.value][pk.span]
        kept = [[s, pk.q - 1]] + ([[pk.p, e]] if pk.b is not None else [])
        self.spans[pk.value][pk.span : pk.span + 1] = kept
        self.mem[pk.q : pk.p] -= self.nbytes[pk.value]
        n = self.nbytes[pk.value]
        if pk.out and pk.value in self.home_out:  # its copy out replaces the copy home (routing adds none then)
            self.lanes["out"].remove(self.home_out.pop(pk.value))
            self.done["out"] = self.lanes["out"].finishes(self.start_s)
        # a park moves no compute (the start times stay): only its lanes' finish times change
        if pk.out:
            way = copy_out_way(pk)
            self.done[way] = self.lanes[way].added(self.start_s, self.done[way], self.copy_out(pk))
        if pk.b is not None:
            self.done["in"] = self.lanes["in"].added(
                self.start_s, self.done["in"], (pk.p, pk.p, self.seconds("in", n), pk.b)
            )
        if pk.out and pk.to is None:
            self.stored_from[pk.value] = min(pk.a, self.stored_from.get(pk.value, pk.a))
            self._reuse_store_copy(pk)
        self.parks.append(pk)
        if pk.b is None:
            self.ended.add(pk.value)  # on the store for good: nothing more to do with it here

    def _reuse_store_copy(self, first: Park) -> None:
        """The parks of `first`'s value whose copies out come after its own (a later gap, its span starting where the
        value is made again, parked before this earlier one) come back from `first`'s copy instead: the store holds
        the value, unchanged, from then on, and a second copy out is link time and a store buffer for nothing. Their
        copies leave the out lane, and each is freed right after its last read before its gap, as routing frees a
        park with no copy out, instead of when its copy out would have been done."""
        for i, pk in enumerate(self.parks):
            if pk.value != first.value or not pk.out or pk.to is not None or pk.a <= first.a:
                continue  # (one gone straight home keeps its own copy: the store's would go home after it)
            self.lanes["out"].remove(self.copy_out(pk))
            self.parks[i] = replace(pk, out=False, q=self._freed_after_read(pk))
        self.done["out"] = self.lanes["out"].finishes(self.start_s)

    def copy_out(self, pk: Park) -> tuple[int, int, float, int]:
        """`pk`'s copy out as its lane holds it (Lane's item): emitted at a, ready at a + 1's start, its seconds,
        done by q's start (where the value is freed)."""
        return (pk.a, pk.a + 1, self.seconds(copy_out_way(pk), self.nbytes[pk.value]), pk.q)

    def _freed_after_read(self, pk: Park) -> int:
        """Free `pk`'s value right after its last read before the gap (pk.read) instead of before pk.q: the span
        holding it to pk.q - 1 ends at the read, its bytes leave the positions between; the new q. Where later moves
        have left no such span, pk.q as it was (the timeline then over-counts those positions, never under)."""
        spans = self.spans[pk.value]
        k = next((k for k, (s, e) in enumerate(spans) if s <= pk.read < e == pk.q - 1), None)
        if k is None:
            return pk.q
        spans[k][1] = pk.read
        self.mem[pk.read + 1 : pk.q] -= self.nbytes[pk.value]
        return pk.read + 1

    def end_rerun(self, v: str, k: int, t: int, budget: int) -> EndRerun | None:
        """Freeing an output after its last read around the peak `t` (and after the autograd boundary) and running
        its producer again at the end, its other inputs held until then; None when that cannot lower `t` or the end
        would not fit (what the eviction heuristic does to forward outputs, as one more move here)."""
        n = len(self.ops)
        if not self.ends_again(v):
            return None  # (a held output freed after the boundary frees nothing)
        s, e = self.spans[v][k]
        if e != n - 1 or any(t <= x for x in self.uses[v] if s < x):
            return None
        free_from = max(s, *(x for x in self.uses[v] if s < x < t), self.boundary) + 1
        if free_from > t:
            return None
        producer = self.graph.op[self.graph.producer[v]]
        changes = [(free_from, n - 1, -self.nbytes[v])]
        extend = []
        for u in dict.fromkeys(producer.inputs):
            if u in self.homed_here or self.held_at(u, n - 1):
                continue
            if (u in self.fixed and u not in self.copied_in) or u in self.ended:
                return None  # parked for good, or a weight fetched only for its reads (one copied in from a third
                # device is held on to the end instead: routing frees it after its last read, the rerun's)
            j = max(range(len(self.spans[u])), key=lambda i: self.spans[u][i][1])
            held_to = self.spans[u][j][1]
            if held_to < n - 1:
                extend.append((u, j))
                changes.append((held_to + 1, n - 1, self.nbytes[u]))
        lo, delta = self.change(changes, n - 1)
        if not self.lowers(t, lo, delta, budget):
            return None
        made = sum(self.nbytes[w] for w in producer.outputs) + self.workspace[producer.id]
        if self.mem[n - 1] + delta[-1] + made > budget:  # the end, with the rerun's outputs and workspace
            return None
        return EndRerun(v, k, free_from, tuple(extend), producer.id, lo, delta)

    def apply_end(self, r: EndRerun) -> None:
        s, _ = self.spans[r.value][r.span]
        self.spans[r.value][r.span] = [s, r.free_from - 1]
        for u, j in r.extend:
            self.spans[u][j][1] = len(self.ops) - 1
        self.mem[r.lo :] += r.delta
        if r.value in self.home_out:  # made again at the end, and copied home after that
            self.lanes["out"].remove(self.home_out.pop(r.value))
        self.ended.add(r.value)
        self.end_redo.append(r.producer)
        self.end_reads.update(self.graph.op[r.producer].inputs)


def _to(home: str) -> str:
    """The name of the lane (and link) from the compute device straight to `home`."""
    return f"to {home}"


def copy_out_way(pk: Park) -> str:
    """The lane of `pk`'s copy out: the store's, or its home's."""
    return "out" if pk.to is None else _to(pk.to)
