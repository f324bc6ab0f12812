"""Where the host AdamW's time goes, on any machine (the GPU machine's host or a CPU): each piece of a bucket's work
alone (torch's fused step, the norm as a 1-D and as a 2-D reduction, the gradient copy, torch.optim's per-call
Python), the old per-bucket path (copy, 1-D norm, AdamW.step()) against HostAdamW's, and HostAdamW end to end with
and without a Python-busy thread beside it (the executor's lanes hold the GIL between their torch calls). The rows
run round-robin `--reps` times; each prints its best and median. `threads` counts the threads that did the work
(per-thread CPU time, Linux)."""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import os
import statistics
import sys
import threading
import time

import torch

from xsched.train.host_adamw import HostAdamW
from xsched.train.host_buckets import adamw_step, make_bucket, sq_norm


def thread_ticks() -> dict[str, int]:
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            out[tid] = int(fields[11]) + int(fields[12])
        except OSError:
            continue
    return out


def busy_threads(fn) -> int:
    """How many threads took a CPU tick while `fn` ran (its work repeated to be seen)."""
    a, t0 = thread_ticks(), time.perf_counter()
    while time.perf_counter() - t0 < 0.3:
        fn()
    b = thread_ticks()
    top = max(v - a.get(k, 0) for k, v in b.items())
    return sum(1 for k, v in b.items() if v - a.get(k, 0) >= max(2, top // 3))


class Python:
    """A thread running Python with a small torch call now and then, as a lane issuing a plan does."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._spin, daemon=True)

    def _spin(self) -> None:
        x = torch.zeros(4)
        while not self.stop.is_set():
            s = 0
            for i in range(2000):  # about 100 us of bytecode between torch calls
                s += i
            x.add_(1)

    def __enter__(self) -> Python:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()


def _spin_process(go, stop) -> None:
    s = 0
    while not stop.is_set():
        if not go.wait(0.05):
            continue
        for i in range(2000):
            s += i


class PythonProcess:
    """The same Python work in a process of its own (spawned before the buffers exist: a forked child would make
    every page the optimizer writes a copy-on-write fault): it takes a core as the thread does, but not the GIL."""

    ctx = multiprocessing.get_context("spawn")
    go = ctx.Event()
    stop = ctx.Event()
    proc = None

    @classmethod
    def start(cls) -> None:
        cls.proc = cls.ctx.Process(target=_spin_process, args=(cls.go, cls.stop), daemon=True)
        cls.proc.start()

    @classmethod
    def end(cls) -> None:
        cls.stop.set()
        if cls.proc is not None:
            cls.proc.join()

    def __enter__(self) -> PythonProcess:
        self.go.set()
        return self

    def __exit__(self, *exc) -> None:
        self.go.clear()


def build(n: int, bucket: int):
    """n parameters in buckets of `bucket` elements, each bucket two segments (decayed and not), a gradient source
    per parameter (where the run's copies come from)."""
    torch.manual_seed(0)
    named, srcs = [], []
    for i in range(n // bucket):
        for j, share in enumerate((bucket - bucket // 64, bucket // 64)):
            p = torch.nn.Parameter(torch.randn(share) * 0.02)
            named.append((f"b{i}.{j}", p))
            srcs.append(torch.randn(share) * 1e-3)
    decay = {name: (0.01 if name.endswith(".0") else 0.0) for name, _ in named}
    return named, srcs, decay


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("n", nargs="?", type=float, default=4e7, help="parameters (default 4e7; 4.5e8 on the GPU host)")
    ap.add_argument("--bucket", type=float, default=8e6, help="elements per bucket (HostAdamW's: 8M fp32)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    bucket = int(a.bucket)
    PythonProcess.start()
    named, srcs, decay = build(int(a.n), bucket)
    n = sum(p.numel() for _, p in named)
    version = sys.version.split()[0]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} cpus, python {version}")
    print(f"{n / 1e6:.0f}M parameters in {len(named) // 2} buckets of {bucket / 1e6:.1f}M elements")

    bs = [make_bucket(k, named[2 * k : 2 * k + 2], decay, 1e-3, separate=False) for k in range(len(named) // 2)]
    segs = [s for b in bs for s in b.segments]
    for s, src in zip(segs, srcs):
        s.grad.copy_(src)
    big = segs[0].grad

    def fused():
        for b in bs:
            adamw_step(b.segments, 1e-3)

    def old_path():  # as HostAdamW did it before: copy, a 1-D norm, torch.optim's step, per segment
        for s, src in zip(segs, srcs):
            s.grad.copy_(src)
            float(torch.linalg.vector_norm(s.grad))
            s.opt.param_groups[0]["lr"] = 1e-3
            s.opt.step()

    def new_path():  # HostAdamW's now: copy (where the run could not land it in place), a 2-D norm, one fused call
        for k, b in enumerate(bs):
            for s, src in zip(b.segments, srcs[2 * k : 2 * k + 2]):
                s.grad.copy_(src)
                sq_norm(s.grad)
            adamw_step(b.segments, 1e-3)

    def new_in_place():  # the run's copy landed the gradient in the buffer: no host copy
        for b in bs:
            sum(sq_norm(s.grad) for s in b.segments)
            adamw_step(b.segments, 1e-3)

    host = HostAdamW(named, decay, 1e-3, bucket_bytes=bucket * 4)
    names = [name for name, _ in named]

    def end_to_end():
        """Every gradient released as a backward would (last layers first); returns (to the norm, to settled)."""
        t0 = time.perf_counter()
        host.begin(True, True, 1e-3)
        for name, src in zip(names, srcs):
            host.released(name, src, [])
        host.end_backward()
        host.grad_norm()
        t1 = time.perf_counter()
        host.settle()
        return t1 - t0, time.perf_counter() - t0

    rows: dict[str, list[float]] = {}
    extra: dict[str, list[float]] = {}

    def timed(name, fn):
        t0 = time.perf_counter()
        fn()
        rows.setdefault(name, []).append(time.perf_counter() - t0)

    def e2e(name, beside, interval: float | None):
        old = sys.getswitchinterval()
        if interval is not None:
            sys.setswitchinterval(interval)
        try:
            before = host.stats().optimizer_s
            with beside():
                norm_s, _ = end_to_end()
            rows.setdefault(name, []).append(host.stats().optimizer_s - before)
            extra.setdefault(name, []).append(norm_s)
        finally:
            sys.setswitchinterval(old)

    small = [(torch.nn.Parameter(torch.randn(1024)), torch.randn(1024)) for _ in range(64)]
    small_b = [make_bucket(k, [(f"s{k}", p)], {f"s{k}": 0.01}, 1e-3, separate=False) for k, (p, _) in enumerate(small)]

    def per_call_optim():
        for b in small_b:
            b.segments[0].opt.step()

    def per_call_direct():
        for b in small_b:
            adamw_step(b.segments, 1e-3)

    plan = [
        ("fused AdamW alone (the floor)", lambda: timed("fused AdamW alone (the floor)", fused)),
        ("old: copy + 1-D norm + AdamW.step()", lambda: timed("old: copy + 1-D norm + AdamW.step()", old_path)),
        ("new: copy + 2-D norm + fused call", lambda: timed("new: copy + 2-D norm + fused call", new_path)),
        ("new, gradient landed in place", lambda: timed("new, gradient landed in place", new_in_place)),
    ]
    for name, beside, interval in [
        ("HostAdamW end to end (worker)", contextlib.nullcontext, None),
        ("  + a Python-busy process (a core)", PythonProcess, None),
        ("  + a Python-busy thread (a core + GIL)", Python, None),
        ("  + busy thread, switch interval 0.5 ms", Python, 5e-4),
    ]:
        plan.append((name, lambda name=name, beside=beside, interval=interval: e2e(name, beside, interval)))
    for fn in (fused, old_path, new_path):
        fn()  # warm: the state is made, the pages touched
    end_to_end()
    for _ in range(a.reps):
        for _, fn in plan:
            fn()
    print(f"\n{'path':42s} {'best':>9s} {'median':>9s} {'Gparam/s':>9s}  note")
    for name, _ in plan:
        ts = rows[name]
        note = f"norm ready after {min(extra[name]) * 1e3:.0f} ms" if name in extra else ""
        print(
            f"{name:42s} {min(ts) * 1e3:7.1f}ms {statistics.median(ts) * 1e3:7.1f}ms {n / min(ts) / 1e9:9.2f}  {note}"
        )

    print(f"\n{'piece (one bucket segment)':42s} {'best':>9s} {'threads':>8s}")
    pieces = [
        ("norm, 1-D (torch.linalg.vector_norm)", lambda: float(torch.linalg.vector_norm(big))),
        ("norm, 2-D rows (sq_norm)", lambda: sq_norm(big)),
        ("gradient copy", lambda: big.copy_(srcs[0])),
        ("fused step", lambda: adamw_step(bs[0].segments[:1], 1e-3)),
    ]
    for name, fn in pieces:
        ts = []
        for _ in range(a.reps * 3):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        print(f"{name:42s} {min(ts) * 1e3:7.2f}ms {busy_threads(fn):8d}")
    for name, fn in (("AdamW.step() on 1K values", per_call_optim), ("fused call on 1K values", per_call_direct)):
        ts = []
        for _ in range(a.reps * 3):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        print(f"{name:42s} {min(ts) / len(small_b) * 1e6:6.0f}us per call")
    host.close()
    PythonProcess.end()


if __name__ == "__main__":
    main()
