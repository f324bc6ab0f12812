"""The host optimizer's work queue: each bucket's tasks run in the order they were made (its gradients in, then its
update, then the next step's gradients), and across buckets the worker takes first the gradients whose copies have
landed (the training loop waits for every bucket's norm, which they compute), then the updates in the order the next
forward reads their buckets (the first layers' first: the forward waits for them first), and waits for a copy still
under way only when nothing else is left to do."""

from __future__ import annotations

import collections
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

TAKE, UPDATE = "take", "update"


@dataclass(frozen=True)
class Task:
    """One piece of a bucket's work: its gradients in (`take`, complete once every event in `events` is) or its
    update; `seq` orders the tasks as they were made."""

    bucket: int
    kind: str
    run: Callable[[], None]
    events: Sequence[Any]
    seq: int


class TaskQueue:
    """Tasks by bucket. `rank[b]`: where the next forward first reads bucket b (lower: sooner). Not thread-safe: the
    optimizer calls it under its own lock."""

    def __init__(self, rank: Sequence[int]) -> None:
        self.rank = list(rank)
        self._chains: dict[int, collections.deque[Task]] = {}
        self._seq = itertools.count()

    def __bool__(self) -> bool:
        return bool(self._chains)

    def push(self, bucket: int, kind: str, run: Callable[[], None], events: Sequence[Any] = ()) -> None:
        self._chains.setdefault(bucket, collections.deque()).append(Task(bucket, kind, run, events, next(self._seq)))

    def pop(self) -> Task:
        """The next task to run (the queue must not be empty)."""
        heads = [chain[0] for chain in self._chains.values()]
        landed = [t for t in heads if t.kind == TAKE and _complete(t.events)]
        updates = [t for t in heads if t.kind == UPDATE]
        if landed:
            task = min(landed, key=lambda t: t.seq)
        elif updates:
            task = min(updates, key=lambda t: (self.rank[t.bucket], t.seq))
        else:
            task = min(heads, key=lambda t: t.seq)  # a copy under way: the worker waits for it
        chain = self._chains[task.bucket]
        chain.popleft()
        if not chain:
            del self._chains[task.bucket]
        return task


def _complete(events: Sequence[Any]) -> bool:
    """Every event has completed, as far as can be asked without waiting (an event that cannot be asked is taken
    as still under way)."""
    return all(callable(getattr(ev, "query", None)) and ev.query() for ev in events)


def read_ranks(bucket_names: Sequence[Sequence[str]], read_order: Sequence[str] | None) -> list[int]:
    """Each bucket's rank in the next forward: the first position of any of its parameters in `read_order`; with
    none given, the buckets released last are read first (a backward releases the first layers' gradients last)."""
    n = len(bucket_names)
    if read_order is None:
        return [n - 1 - b for b in range(n)]
    pos = {name: i for i, name in reversed(list(enumerate(read_order)))}
    late = len(pos)
    return [
        min((pos.get(name, late + n - 1 - b) for name in names), default=late + n - 1 - b)
        for b, names in enumerate(bucket_names)
    ]
