"""A copy lane of park's timeline (`park_model.ParkTimeline`): its copies in plan order, each run once the one before
it is done and its ready position has started, and the lateness a copy inserted among them adds behind it."""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class Lane:
    """A copy lane's copies in plan order: (emit position, position whose start it is ready at, seconds, position
    whose start it must be done by), sorted by emit position, equal ones in the order they were added."""

    items: list[tuple[int, int, float, int]]
    emits: list[int] = field(default_factory=list)  # the items' emit positions, kept beside them for bisect

    def add(self, item: tuple[int, int, float, int]) -> int:
        """Insert `item` at its slot; its index."""
        at = self.slot(item[0])
        self.items.insert(at, item)
        self.emits.insert(at, item[0])
        return at

    def remove(self, item: tuple[int, int, float, int]) -> None:
        """Take out the first copy equal to `item`."""
        at = self.items.index(item)
        del self.items[at]
        del self.emits[at]

    def finishes(self, start: Sequence[float], begin: int = 0, prev: float = 0.0) -> list[float]:
        """When each copy from index `begin` on is done, the one before it done at `prev`."""
        out = []
        for _, ready, secs, _ in self.items[begin:]:
            r = start[ready]
            prev = (r if r >= prev else prev) + secs  # max(r, prev): a call is dear in this loop
            out.append(prev)
        return out

    def added(self, start: Sequence[float], done: list[float], item: tuple[int, int, float, int]) -> list[float]:
        """Insert `item` and return the finish times given `done` before it: those ahead of its slot are unchanged,
        so only the copies from it on are timed again (adding one copy at a time stays linear, not quadratic)."""
        at = self.add(item)
        return done[:at] + self.finishes(start, at, done[at - 1] if at else 0.0)

    def slot(self, emit: int) -> int:
        """Where a copy emitted at `emit` goes: after every copy emitted at or before it."""
        return bisect.bisect_right(self.emits, emit)

    def delay(self, start: Sequence[float], done: Sequence[float], at: int, first_done: float) -> float:
        """The lateness a copy inserted at index `at`, done at `first_done`, adds to the copies after it."""
        extra, prev = 0.0, first_done
        for j in range(at, len(self.items)):
            _, ready, secs, due = self.items[j]
            r = start[ready]
            moved = (r if r >= prev else prev) + secs  # (max spelled out: a call is dear in this loop)
            was = done[j]
            if moved <= was + 1e-15:
                break  # the queue behind is as before
            d = start[due]
            extra += (moved - d if moved - d > 0.0 else 0.0) - (was - d if was - d > 0.0 else 0.0)
            prev = moved
        return extra
