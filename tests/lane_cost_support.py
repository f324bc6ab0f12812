"""A fake CUDA for the executor's lanes on logical CPUs: its compute and copy lanes become "cuda" lanes on fake
streams, and torch.cuda.Event a fake that counts what the lanes record and wait for. Each stream keeps a vector
clock (how far into every stream's work it is ordered after), so a test can check, independently of the lanes'
bookkeeping, that every step runs on its stream after the steps the overlap model makes it wait for."""

from __future__ import annotations

import contextlib
import threading
from collections import Counter
from typing import Any

import torch

from xsched.contracts.plan import Compute, Copy, Free
from xsched.execute.steps import STEP_KINDS

_CURRENT = threading.local()  # the fake stream torch.cuda.stream made current on this thread


@contextlib.contextmanager
def current(stream: FakeStream | None) -> Any:
    """torch.cuda.stream on the fakes: `stream` is this thread's current stream inside."""
    before = getattr(_CURRENT, "stream", None)
    _CURRENT.stream = stream
    try:
        yield
    finally:
        _CURRENT.stream = before


class FakeStream:
    """A stream: `pos` counts the steps issued onto it; `vc[s]` is how many of stream s's it is ordered after."""

    def __init__(self, name: str, counts: Counter[str]) -> None:
        self.name, self.counts = name, counts
        self.pos = 0
        self.vc: dict[str, int] = {}
        self.waited: dict[str, int] = {}  # stream -> the latest of its positions waited for directly

    def wait_event(self, ev: FakeEvent) -> None:
        self.counts["wait_event"] += 1
        if ev.stream == self.name:
            self.counts["own_wait"] += 1  # behind this stream's work already
        elif ev.pos <= self.waited.get(ev.stream, -1):
            self.counts["repeated_wait"] += 1  # an event at or before one this stream waited for
        self.waited[ev.stream] = max(self.waited.get(ev.stream, -1), ev.pos)
        for s, p in ev.vc.items():
            self.vc[s] = max(self.vc.get(s, 0), p)

    def wait_stream(self, other: FakeStream) -> None:
        self.counts["wait_stream"] += 1


class FakeEvent:
    """torch.cuda.Event: what was issued onto its stream when recorded (the stream's vector clock and position)."""

    counts: Counter[str] = Counter()

    def __init__(self, enable_timing: bool = False, **kwargs: Any) -> None:
        self.vc: dict[str, int] = {}
        self.stream, self.pos = "", -1

    def record(self, stream: FakeStream | None = None) -> None:
        assert stream is not None, "a lane records its events on its own stream"
        FakeEvent.counts["record"] += 1
        self.stream, self.pos = stream.name, stream.pos
        self.vc = {**stream.vc, stream.name: stream.pos}

    def synchronize(self) -> None:
        FakeEvent.counts["synchronize"] += 1

    def elapsed_time(self, other: FakeEvent) -> float:
        return 0.0


def fake_cuda(ex: Any, monkeypatch: Any) -> None:
    """Make `ex`'s compute and copy lanes CUDA lanes on fake streams, one per lane (before its first lanes run: the
    threads start then), and torch.cuda's Event and stream context the fakes."""
    FakeEvent.counts = Counter()
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "stream", current)
    for key, lane in ex.lanes.items():
        assert lane._thread is None, "fake_cuda must come before the lanes start"
        if not key.startswith("free:"):
            lane.kind, lane.stream = "cuda", FakeStream(key, FakeEvent.counts)


class Positions:
    """Step kinds that note, as each step runs, where it is on its lane's fake stream and what that stream is
    ordered after by then (the stream's vector clock)."""

    def __init__(self) -> None:
        self.at: dict[int, tuple[str, int, dict[str, int]]] = {}  # step -> (stream, position, vector clock)

    def table(self) -> dict[type, Any]:
        return {kind: self._noting(STEP_KINDS[kind]) for kind in (Compute, Copy, Free)}

    def _noting(self, prepare: Any) -> Any:
        def make(ex: Any, i: int, s: Any) -> Any:
            fn = prepare(ex, i, s)

            def run(st: Any) -> None:
                stream = getattr(_CURRENT, "stream", None)  # a lane thread's, or the one issuer's for this task
                if stream is not None:  # on a CUDA lane: the step is issued onto its stream here
                    stream.pos += 1
                    self.at[i] = (stream.name, stream.pos, dict(stream.vc))
                fn(st)

            return run

        return make

    def unordered(self, ex: Any) -> list[tuple[int, int]]:
        """(step, step it must follow) where a step on a stream is not ordered after a CUDA step the overlap model
        makes it wait for: directly, or through the free lanes, which hand on the events of every earlier free's
        waits in the run."""
        need: dict[int, set[int]] = {}
        carried: dict[str, set[int]] = {}  # free lane -> the CUDA steps its frees so far waited for
        for i, key in enumerate(ex.lane_of):
            direct = {j for d in ex.deps[i] for j in ({d} if d in self.at else need.get(d, set()))}
            if key.startswith("free:"):
                need[i] = carried[key] = carried.get(key, set()) | direct
            else:
                need[i] = direct
        bad = []
        for i, (stream, pos, vc) in self.at.items():
            for j in need[i]:
                other, at_j, _ = self.at[j]
                if (pos <= at_j) if other == stream else vc.get(other, 0) < at_j:
                    bad.append((i, j))
        return bad
