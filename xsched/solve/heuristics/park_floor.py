"""Floors under the scores of park's moves on a value (`park._best_move` skips what cannot beat its best so far)."""

from __future__ import annotations

from collections.abc import Mapping

from xsched.solve.heuristics.park_model import ParkTimeline

# floors of a drop, a park, an end rerun and the least of them (None: that kind of move never applies)
Kinds = tuple[float | None, float | None, float | None, float | None]


class Floors:
    """Per value, a floor under each kind of move's unjittered score (drop, park, end rerun; None where the kind
    never applies to it: its method returns None before scoring anything) and the least of them. Kept for the run
    of the greedy, computed again only when what it depends on changes (the store holding a copy of the value, the
    value gone for good); the rest is fixed once the timeline is made. A drop or an end rerun runs at least v's
    producer again and frees at most v's bytes (what it holds longer only adds); a park costs at least its link
    price, for the copy out unless the store holds v from some position on, and the copy back unless v may stay
    there for good. Computed as the moves compute their scores, term for term, so rounding keeps each floor at or
    below them."""

    def __init__(self, line: ParkTimeline, price: float | None, cost: Mapping[str, float]) -> None:
        self.line, self.price, self.cost = line, price, cost
        # value -> ((on the store from some position, gone for good), its floors then)
        self.kept: dict[str, tuple[tuple[bool, bool], Kinds]] = {}

    def of(self, v: str) -> Kinds:
        """`v`'s floors: (drop, park, end rerun, the least of them)."""
        state = (v in self.line.stored_from, v in self.line.ended)
        kept = self.kept.get(v)
        if kept is None or kept[0] != state:
            kept = self.kept[v] = (state, self._floors(v))
        return kept[1]

    def _floors(self, v: str) -> Kinds:
        line, n = self.line, self.line.nbytes[v]
        producer = line.graph.producer.get(v)
        rerun = self.cost[producer] / n if producer is not None else None
        drop = rerun if v not in line.fixed else None  # (a value with no producer is a graph input: fixed)
        end = rerun if line.ends_again(v) else None
        park = None
        if self.price is not None and line.parkable(v):
            link_s = 0.0
            if v not in line.stored_from:
                link_s += line.leave_seconds(v)
            if v not in line.may_leave:
                link_s += line.seconds("in", n)
            park = self.price * link_s / n
        applies = [f for f in (drop, park, end) if f is not None]
        return drop, park, end, min(applies, default=None)
