"""Where a training step's time goes: the executor's lanes (compute, copies in, copies out; GPU time from CUDA events
where a lane issues onto a stream, host time otherwise), its runs (forward, backward), the host optimizer's buckets
and the waits for them, as one breakdown per step and as Chrome-trace spans of the latest step."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

KINDS = ("compute", "copy_in", "copy_out", "free")


@dataclass
class _Spans:
    # (lane, label, start, end, CPU, thread): seconds; CPU: the running thread's own CPU time inside the span, thread:
    # its native id (None: not read)
    host: list[tuple[str, str, float, float, float | None, int | None]] = field(default_factory=list)
    cuda: list[tuple[str, str, Any, Any, float]] = field(default_factory=list)  # (lane, label, ev0, ev1, host t0)
    runs: list[tuple[str, float, float]] = field(default_factory=list)  # executor runs: (forward|backward, t0, t1)
    waits: list[tuple[str, float, float]] = field(default_factory=list)  # the lanes' and loop's waits for updates
    staged: list[tuple[int, int]] = field(default_factory=list)  # per run: host sources pinned by a copy, their bytes
    # native thread id -> its scheduler counters (thread_counters) when it first ran a timed task in this step
    threads: dict[int, tuple[float, float, float] | None] = field(default_factory=dict)


class StepClock:
    """Timers an executor and a host optimizer report to (from any thread). `kind_of(lane)` names a lane's kind
    (compute, copy_in, copy_out, free); `start()` opens a step, `read()` closes it and returns its breakdown in
    seconds: wall, forward/backward (the executor's runs), per kind the busy time (GPU time on a CUDA stream), the
    host time spent issuing it (the wall inside its tasks) and the issuing thread's own CPU time within it (the
    rest of that wall is waiting: for the GIL, a lock, a blocking CUDA call), the tasks run, the context switches
    of the threads that ran them (from their first task of the step to its end: all, and those the machine forced,
    preempted) and their run-queue wait (ready with no core free: the machine's share of the waiting; a thread
    that ran several kinds, as an inline run's does, counts in each; Linux only: other systems leave these out),
    the compute lanes' idle time inside the runs (waiting for copies or for Python), the optimizer's busy time per
    bucket, the time reads and the loop waited for it, what is outside the runs (autograd, the loss, the loop's
    Python), and the copies' host sources staged through pinned memory
    (a count and bytes, not seconds)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._s = _Spans()
        self._t0 = time.perf_counter()
        self.kind_of: dict[str, str] = {}
        self.last: _Spans = _Spans()
        self.last_t0 = self._t0

    # ---- recording ----
    def start(self) -> None:
        with self._lock:
            self._s, self._t0 = _Spans(), time.perf_counter()

    def timed(self, lane: str, label: str, fn: Callable[[Any], None], stream: Any = None) -> Callable[[Any], Any]:
        """`fn` timed on `lane`: host start and end, the CPU time of the thread running it (time.thread_time: it
        runs on the lane's thread, or inline on the caller's), and CUDA events around it on `stream` when given; it
        returns the end event, which marks the task done on the device too (workers.Lane.finished: one event less
        each)."""
        spans, cpu = self, time.thread_time
        if stream is None:
            return self._host_timed(lane, label, fn)

        def run(arg: Any) -> Any:
            tid = spans._first_task()
            t0, c0 = time.perf_counter(), cpu()
            ev0 = torch.cuda.Event(enable_timing=True)
            ev0.record(stream)
            try:
                fn(arg)
            finally:
                ev1 = torch.cuda.Event(enable_timing=True)
                ev1.record(stream)
                c1 = cpu()  # read inside the wall span, so the CPU is never the longer of the two by the reads' order
                spans.span(lane, label, t0, time.perf_counter(), (ev0, ev1), c1 - c0, tid)
            return ev1

        return run

    def _host_timed(self, lane: str, label: str, fn: Callable[[Any], None]) -> Callable[[Any], None]:
        """`fn` timed on a lane with no stream: its host start and end and its thread's CPU time (what `span`
        records, with less Python per call: inline runs call this once per program or copy, thousands of times a
        step)."""
        lock, clock, cpu, first = self._lock, time.perf_counter, time.thread_time, self._first_task

        def run(arg: Any) -> None:
            tid = first()
            t0, c0 = clock(), cpu()
            try:
                fn(arg)
            finally:
                c1 = cpu()
                t1 = clock()
                with lock:
                    self._s.host.append((lane, label, t0, t1, c1 - c0, tid))

        return run

    def _first_task(self) -> int:
        """This thread's native id, its scheduler counters kept when it runs its first timed task of the step."""
        tid = threading.get_native_id()
        threads = self._s.threads
        if tid not in threads:
            counters = thread_counters(tid)  # None (no /proc) is kept too: read once a step and thread, not per task
            with self._lock:
                threads.setdefault(tid, counters)
        return tid

    def span(
        self,
        lane: str,
        label: str,
        t0: float,
        t1: float,
        cuda: tuple[Any, Any] | None = None,
        cpu: float | None = None,
        tid: int | None = None,
    ) -> None:
        """A span of `lane` from t0 to t1 (perf_counter), its CUDA events, and its thread's CPU time and native id
        when known."""
        with self._lock:
            self._s.host.append((lane, label, t0, t1, cpu, tid))
            if cuda is not None:
                self._s.cuda.append((lane, label, cuda[0], cuda[1], t0))

    def run(self, label: str, t0: float, t1: float) -> None:
        with self._lock:
            self._s.runs.append((label, t0, t1))

    def staged(self, copies: int, nbytes: int) -> None:
        """A run's copies to a GPU staged `copies` host sources that were not pinned (`nbytes` in all) through new
        pinned buffers (xsched.execute.steps.pinned): host work and a slower copy each, every step."""
        with self._lock:
            self._s.staged.append((copies, nbytes))

    def waited(self, what: str, t0: float, t1: float) -> None:
        with self._lock:
            self._s.waits.append((what, t0, t1))

    def settled(self) -> None:
        """Once the loop has waited for the optimizer: its spans recorded since the last step closed (the updates
        that ran past the close, as the last step's do) join that step, so its trace shows them."""
        with self._lock:
            late = [h for h in self._s.host if h[0] == "optimizer"]
            self._s.host[:] = [h for h in self._s.host if h[0] != "optimizer"]
        self.last.host.extend(late)

    # ---- reading ----
    def read(self) -> dict[str, Any]:
        """Close the step: its breakdown (the CUDA events it recorded must be complete: synchronise first)."""
        t1 = time.perf_counter()
        with self._lock:
            s, t0 = self._s, self._t0
            self._s, self._t0 = _Spans(), t1
        self.last, self.last_t0 = s, t0
        gpu = {(lane, a): (ev0, ev1) for lane, _, ev0, ev1, a in s.cuda}
        out: dict[str, Any] = {"wall_s": t1 - t0}
        for label in ("forward", "backward"):
            out[f"{label}_s"] = float(sum(b - a for x, a, b in s.runs if x == label))
        runs = out["forward_s"] + out["backward_s"]
        busy = dict.fromkeys(KINDS, 0.0)
        issue = dict.fromkeys(KINDS, 0.0)
        issue_cpu = dict.fromkeys(KINDS, 0.0)
        tasks = dict.fromkeys(KINDS, 0)
        tids: dict[str, set[int]] = {k: set() for k in KINDS}
        buckets: dict[str, float] = {}
        for lane, label, a, b, cpu, tid in s.host:
            kind = self.kind_of.get(lane)
            if lane == "optimizer":
                buckets[label] = buckets.get(label, 0.0) + b - a
                continue
            if kind is None:
                continue
            issue[kind] += b - a
            issue_cpu[kind] += cpu or 0.0
            tasks[kind] += 1
            if tid is not None:
                tids[kind].add(tid)
            ev = gpu.get((lane, a))
            busy[kind] += ev[0].elapsed_time(ev[1]) / 1e3 if ev is not None else b - a
        for kind in KINDS:
            out[f"{kind}_s"] = busy[kind]
            out[f"{kind}_issue_s"] = issue[kind]
            out[f"{kind}_issue_cpu_s"] = issue_cpu[kind]
            out[f"{kind}_tasks"] = float(tasks[kind])  # floats, as every scalar a bench takes medians of
        out.update(_switches(s.threads, tids))
        out["compute_idle_s"] = max(0.0, runs - busy["compute"])
        out["outside_runs_s"] = max(0.0, out["wall_s"] - runs)
        out["optimizer_s"] = float(sum(buckets.values()))
        out["optimizer_buckets_s"] = [buckets[k] for k in sorted(buckets, key=_bucket_index)]
        for what in ("read", "step"):
            out[f"optimizer_wait_{what}_s"] = float(sum(b - a for x, a, b in s.waits if x == what))
        out["staged_copies"] = float(sum(n for n, _ in s.staged))  # floats, as every scalar a bench takes medians of
        out["staged_bytes"] = float(sum(b for _, b in s.staged))
        return out

    def trace(self, name: str = "step") -> dict[str, Any]:
        """The latest closed step as a Chrome trace: one thread per lane (host spans; GPU spans on their own
        threads, placed by their host start), the optimizer's buckets, the runs and the waits."""
        s, t0 = self.last, self.last_t0
        tids: dict[str, int] = {}
        events: list[dict[str, Any]] = []

        def add(thread: str, label: str, a: float, dur: float, args: Mapping[str, Any] | None = None) -> None:
            tid = tids.setdefault(thread, len(tids) + 1)
            ev = {"name": label, "ph": "X", "pid": 1, "tid": tid, "ts": a * 1e6, "dur": max(dur, 0.0) * 1e6}
            events.append({**ev, "args": dict(args or {})})

        for label, a, b in s.runs:
            add("runs", label, a - t0, b - a)
        gpu = {(lane, a): (ev0, ev1) for lane, _, ev0, ev1, a in s.cuda}
        for lane, label, a, b, cpu, _ in s.host:
            args = {} if cpu is None else {"thread CPU (ms)": round(cpu * 1e3, 4)}
            add(f"{lane} (host)" if (lane, a) in gpu else lane, label, a - t0, b - a, args)
        ref = min(s.cuda, key=lambda c: c[4], default=None)
        for lane, label, ev0, ev1, _ in s.cuda:
            assert ref is not None
            start = ref[4] - t0 + ref[2].elapsed_time(ev0) / 1e3
            add(f"{lane} (GPU)", label, start, ev0.elapsed_time(ev1) / 1e3)
        for what, a, b in s.waits:
            add(f"wait for optimizer ({what})", what, a - t0, b - a)
        names = [
            {"name": "thread_name", "ph": "M", "pid": 1, "tid": tid, "args": {"name": n}} for n, tid in tids.items()
        ]
        return {"traceEvents": names + events, "displayTimeUnit": "ms", "otherData": {"name": name}}


def thread_counters(tid: int) -> tuple[float, float, float] | None:
    """Linux's scheduler counters of this process's thread `tid` (/proc): its context switches, those not voluntary
    (the machine took its core; a voluntary one is a wait, for another thread or for the GIL), and its run-queue wait
    in seconds; None where /proc has none."""
    try:
        with open(f"/proc/self/task/{tid}/status") as f:
            got = {k: float(v) for k, v, *_ in (line.split() for line in f if "ctxt_switches:" in line)}
        with open(f"/proc/self/task/{tid}/schedstat") as f:
            ready = int(f.read().split()[1]) / 1e9
        forced = got["nonvoluntary_ctxt_switches:"]
        return got["voluntary_ctxt_switches:"] + forced, forced, ready
    except (OSError, KeyError, IndexError, ValueError):
        return None


def _switches(first: Mapping[int, tuple[float, float, float] | None], tids: Mapping[str, set[int]]) -> dict[str, float]:
    """Per kind, the scheduler counters' growth since each of its threads' first task of the step (those read)."""
    out: dict[str, float] = {}
    now = {tid: thread_counters(tid) for tid, c in first.items() if c is not None}
    for kind, seen in tids.items():
        pairs = [(a, b) for t in seen if (a := first.get(t)) is not None and (b := now.get(t)) is not None]
        if len(pairs) < len(seen):  # no /proc (or a thread gone): leave the kind's counts out, not a partial sum
            continue
        for k, key in enumerate(("switches", "preempted", "ready_s")):
            out[f"{kind}_{key}"] = float(sum(b[k] - a[k] for a, b in pairs))
    return out


def _bucket_index(label: str) -> int:
    tail = label.rsplit(" ", 1)[-1]
    return int(tail) if tail.isdigit() else 0


def lane_kinds(lanes: Iterable[str], computes: set[str]) -> dict[str, str]:
    """Each lane name of xsched.lanes ("compute:<d>", "copy:<src>-><dst>", "free:<d>") -> its kind: a copy is in
    when its destination computes, out otherwise."""
    out = {}
    for key in set(lanes):
        kind, where = key.split(":", 1)
        if kind == "copy":
            kind = "copy_in" if where.split("->")[1] in computes else "copy_out"
        out[key] = kind
    return out
