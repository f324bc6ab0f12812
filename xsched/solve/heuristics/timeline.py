"""The one timeline of the heuristics that evict or park (`checkpoint`'s eviction, `offload`, `gaps`, `park`): for a
compute order on one device, where each value is made, read and held, and the bytes resident at each position; and
the move they share, freeing a value between two reads and running its producer again before the later one.
`Liveness` (made, read, stretches between uses: offload), `Timeline` (residencies and bytes, the rerun move: gaps,
and park's `park_model.ParkTimeline`), `Resident` (the same order seen online: eviction)."""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from xsched.budgets import format_bytes
from xsched.contracts.graph import Graph, Op
from xsched.contracts.holds import pinned_holds
from xsched.contracts.plan import Compute, autograd_boundary
from xsched.contracts.profile import Profile
from xsched.errors import BudgetError
from xsched.solve.heuristics.routing import op_workspace

MAX_RERUNS = 8  # values made again for one drop, past which the inputs are held longer instead


def op_seconds(graph: Graph, device: str, profile: Profile | None, untimed: float = 1.0) -> dict[str, float]:
    """Each op's time on `device`, `untimed` where the profile has none (or there is no profile): a rerun's price."""
    return {o.id: (c.time_s if profile and (c := profile.op_cost(o.id, device)) else untimed) for o in graph.ops}


@dataclass(frozen=True)
class Drop:
    """Free `value` after its use at position `a`, run its producer again right before position `b`; `extend`
    holds inputs of the reruns past their last use to `b` (value, span index, from, to)."""

    value: str
    span: int
    a: int
    b: int
    extend: tuple[tuple[str, int, int, int], ...]
    reruns: tuple[str, ...]  # ops to run before position b: `value`'s producer and what it needs made again
    lo: int
    delta: np.ndarray  # the change in bytes at positions lo..b

    def freed(self, t: int) -> np.int64:
        """The bytes the drop frees at position `t`."""
        return -self.delta[t - self.lo]


class Liveness:
    """Where each value is made and read in one device's compute order (an op may run at several positions): `made`
    and `uses`, each value's positions (every value of the graph, in its order; ascending, each once), and
    `stretches`, (event, next read, value) from each position that makes or reads a value to the next that reads it,
    in the order of those reads. `boundary` is the first position of backward (-1 when none) and `held` the outputs
    the caller holds from there to the end (`graph.held_outputs`; none without a backward): no stretch of one
    reaches past the boundary, since nothing freed there releases memory (`autograd_boundary.hold_to_end`)."""

    def __init__(self, graph: Graph, ops: Sequence[Op], device: str) -> None:
        self.graph, self.device = graph, device
        self.ops = list(ops)
        self.boundary = backward_start(graph, self.ops)
        self.held = frozenset(pinned_holds(graph)) if self.boundary >= 0 else frozenset()
        self.uses: dict[str, list[int]] = {v.id: [] for v in graph.values}
        self.made: dict[str, list[int]] = {v.id: [] for v in graph.values}
        self.stretches: list[tuple[int, int, str]] = []
        last: dict[str, int] = {}
        for t, op in enumerate(self.ops):
            for v in dict.fromkeys(op.inputs):
                self.uses[v].append(t)
                if v in last and not (v in self.held and t > self.boundary):
                    self.stretches.append((last[v], t, v))
                last[v] = t
            for v in op.outputs:
                self.made[v].append(t)
                last[v] = t


def backward_start(graph: Graph, ops: Sequence[Op]) -> int:
    """The first position in `ops` of a backward op or of one reading a tangent (`plan.autograd_boundary`'s rule),
    -1 when there is none."""
    b = autograd_boundary(graph, [Compute(op.id, "") for op in ops])
    return -1 if b is None or b == len(ops) else b


class Timeline(Liveness):
    """The liveness of one device's compute order, each op once, with each value's residencies as spans [first,
    last] of positions (`spans`: made, or held from the start for a graph input, to its last read; graph inputs,
    outputs and held outputs to the end), and the bytes resident at each position (`mem`: the spans and each op's
    workspace). A move (`apply`) splits spans and makes values again before a position (`redo`), keeping `spans`,
    `uses` and `mem` current; `made` and `stretches` stay those of the order as given."""

    def __init__(self, graph: Graph, ops: Sequence[Op], device: str, profile: Profile | None = None) -> None:
        super().__init__(graph, ops, device)
        n = len(self.ops)
        self.workspace = {op.id: op_workspace(op, device, profile) for op in self.ops}
        self.mem = np.array([self.workspace[op.id] for op in self.ops], dtype=np.int64)
        self.nbytes = {v.id: v.nbytes for v in graph.values}
        self.fixed = set(graph.inputs) | set(graph.outputs) | self.held
        self.spans: dict[str, list[list[int]]] = {}
        for v in graph.values:
            made = self.made[v.id][0] if self.made[v.id] else 0  # a graph input is held from the start
            last = n - 1 if v.id in self.fixed else max(self.uses[v.id], default=made)
            self.spans[v.id] = [[made, last]]
            self.mem[made : last + 1] += v.nbytes
        self.redo: dict[int, list[str]] = {}  # position -> producers run again right before it

    def held_at(self, v: str, t: int) -> bool:
        return any(s <= t <= e for s, e in self.spans[v])

    def gap(self, v: str, k: int, t: int) -> tuple[int, int | None] | None:
        """The gap of span `k` of `v` around position `t`: (its last read before `t`, the span's start counting as
        one; its next read after `t` in the span, None if none), or None when `v` is read at `t` or nothing is
        before it."""
        s, e = self.spans[v][k]
        if t == s:
            return None
        # the reads in the span after its start, uses[v][lo:hi] (ascending, each once), found by bisection: every
        # candidate of every move asks this, and a value may be read at many positions
        uses = self.uses[v]
        lo, hi = bisect.bisect_right(uses, s), bisect.bisect_right(uses, e)
        j = bisect.bisect_left(uses, t, lo, hi)  # the first read in the span at or after t
        if j < hi and uses[j] == t:
            return None
        a = uses[j - 1] if j > lo else (s if s < t else None)
        if a is None:
            return None
        return a, (uses[j] if j < hi else None)  # (a is not None: s < t, so s is no read after t)

    def change(self, changes: Sequence[tuple[int, int, int]], last: int) -> tuple[int, np.ndarray]:
        """(lo, delta): the change in bytes at positions lo..`last` from (first, last, bytes) changes."""
        lo = min(c[0] for c in changes)
        delta = np.zeros(last + 1 - lo, dtype=np.int64)  # nothing changes outside them
        for first, end, n in changes:
            delta[first - lo : end + 1 - lo] += n
        return lo, delta

    def lowers(self, t: int, lo: int, delta: np.ndarray, budget: int) -> bool:
        """The change lowers position `t` and pushes no position it grows over the budget (or, over it already,
        higher)."""
        if delta[t - lo] >= 0:
            return False
        grown = delta > 0
        window = self.mem[lo : lo + len(delta)]
        return not np.any(window[grown] + delta[grown] > np.maximum(window[grown], budget))

    def drop(self, v: str, k: int, t: int, budget: int, depth: int) -> Drop | None:
        """Freeing span `k` of `v` around position `t`, or None when `v` is read at `t`, the gap does not cover
        `t`, or the change does not lower `t` or pushes another position over the budget."""
        gap = self.gap(v, k, t)
        if gap is None or gap[1] is None:
            return None
        a, b = gap
        changes = [(a + 1, b - 1, -self.nbytes[v])]
        extend: list[tuple[str, int, int, int]] = []
        reruns: list[str] = []
        self._rerun(v, b, t, depth, changes, extend, reruns, {v})
        # lowers' first test, summed before any array is built: most candidates fail it (the inputs held longer
        # over t outweigh v; on GPT-2, 99% of them)
        if sum(n for first, last, n in changes if first <= t <= last) >= 0:
            return None
        lo, delta = self.change(changes, b)
        if not self.lowers(t, lo, delta, budget):
            return None
        return Drop(v, k, a, b, tuple(extend), tuple(reruns), lo, delta)

    def _rerun(
        self, v: str, b: int, t: int, depth: int, changes: list, extend: list, reruns: list, ready: set[str]
    ) -> None:
        """Run `v`'s producer again right before position `b`: each input it needs that is gone by then is held
        longer, or, when holding it would cover the peak `t`, made again there too (up to `depth` levels)."""
        producer = self.graph.op[self.graph.producer[v]]
        for u in dict.fromkeys(producer.inputs):
            if u in ready or self.held_at(u, b):
                continue
            ready.add(u)
            j = max(j for j, (_, end) in enumerate(self.spans[u]) if end < b)  # u was made before its reader
            held_to = self.spans[u][j][1]
            if held_to < t and depth > 0 and u in self.graph.producer and len(ready) <= MAX_RERUNS:
                changes.append((b, b, self.nbytes[u]))  # made again, gone after this position
                self._rerun(u, b, t, depth - 1, changes, extend, reruns, ready)
            else:
                extend.append((u, j, held_to + 1, b))
                changes.append((held_to + 1, b, self.nbytes[u]))
        # the rerun's other outputs and workspace, beyond what the op at b itself adds there
        op_b = self.ops[b]
        rerun = sum(self.nbytes[w] for w in producer.outputs if w != v) + self.workspace[producer.id]
        own = sum(self.nbytes[w] for w in op_b.outputs) + self.workspace[op_b.id]
        changes.append((b, b, max(0, rerun - own)))
        reruns.append(producer.id)

    def apply(self, d: Drop) -> None:
        s, e = self.spans[d.value][d.span]
        self.spans[d.value][d.span : d.span + 1] = [[s, d.a], [d.b, e]]
        for u, j, _, to in d.extend:
            self.spans[u][j][1] = to
        for p in d.reruns:
            for w in self.graph.op[p].outputs:
                self.spans[w].append([d.b, d.b])
            for u in self.graph.op[p].inputs:
                if d.b not in self.uses[u]:
                    self.uses[u] = sorted([*self.uses[u], d.b])
        for u in {x for x, *_ in d.extend} | {w for p in d.reruns for w in self.graph.op[p].outputs}:
            self.spans[u] = _merged(self.spans[u])
        self.redo.setdefault(d.b, []).extend(d.reruns)
        self.mem[d.lo : d.b + 1] += d.delta

    def reruns_at(self, t: int) -> list[str]:
        """The producers run again right before position `t`, each once, in graph order."""
        return sorted(set(self.redo.get(t, ())), key=self.graph.op_index.__getitem__)

    def computes(self) -> list[Compute]:
        out = []
        for t, op in enumerate(self.ops):
            out += [Compute(p, self.device) for p in self.reruns_at(t)]
            out.append(Compute(op.id, self.device))
        return out

    def peak_error(self, method: str, t: int, budget: int) -> BudgetError:
        """`method` found nothing that lowers the peak at position `t`: the op, its bytes and the budget."""
        return BudgetError(
            f"{method} cannot lower the peak at {self.ops[t].id}: "
            f"{format_bytes(int(self.mem[t]))} over a budget of {format_bytes(budget)} on {self.device}",
            stage="solve",
            op=self.ops[t].id,
            device=self.device,
        )


def _merged(spans: list[list[int]]) -> list[list[int]]:
    out: list[list[int]] = []
    for s, e in sorted(spans):
        if out and s <= out[-1][1] + 1:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return out


class Resident:
    """The same order seen online, as eviction decides its recomputes on the way: the values held on the device,
    their bytes, and each value's reads still to come (positions in graph order)."""

    def __init__(self, graph: Graph, device: str, fixed: set[str]) -> None:
        self.nbytes = {v.id: v.nbytes for v in graph.values}
        self.ahead = {v: reads[::-1] for v, reads in Liveness(graph, graph.ops, device).uses.items()}  # next read last
        self.fixed = fixed  # held to the end, never evicted
        self.held = set(graph.inputs)
        self.used = sum(self.nbytes[v] for v in self.held)

    def hold(self, values: Iterable[str]) -> None:
        fresh = [v for v in values if v not in self.held]
        self.held.update(fresh)
        self.used += sum(self.nbytes[v] for v in fresh)

    def evict(self, v: str) -> None:
        self.held.discard(v)
        self.used -= self.nbytes[v]

    def release(self, op: Op, t: int) -> None:
        """After `op` at position `t`: its reads there are done, and what it read or made that nothing reads later
        leaves the device, unless fixed."""
        for v in dict.fromkeys((*op.inputs, *op.outputs)):
            ahead = self.ahead[v]
            while ahead and ahead[-1] <= t:
                ahead.pop()
            if not ahead and v not in self.fixed and v in self.held:
                self.evict(v)
