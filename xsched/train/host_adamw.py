"""AdamW on the host, overlapped with the run: the trained parameters packed into flat buckets in the order the
plan's backward releases them, each bucket's gradients taken in (and their norm) by a worker thread as soon as
they have arrived, its fused CPU AdamW step run once the landed gradients are in, the buckets the next forward
reads first updated first (xsched.train.host_tasks), and a later read of a parameter waiting for its own bucket
only. Low-precision parameters (bf16) get fp32 master weights and fp32 gradients on the host: the update steps the
master, then writes the bf16 weights the run reads. Its state reads and loads as torch.optim.AdamW's state dict over the parameters (plus the
master weights), so checkpoints resume across either optimizer.

The delayed update (`delayed=True`, ZeRO-Offload's one-step delayed parameter update): the update made from step
s's gradients is written into the weights the run reads only once step s+1's forward and backward have read them,
so step s+1 never waits for AdamW. Exactly: with w_0 the initial weights, g_s the gradient of step s's loss taken at
the weights step s reads, and m_{s+1} = AdamW(m_s, g_s) the master weights (m_0 = w_0), step 0 and step 1 read w_0
and step s >= 2 reads m_{s-1} (rounded to the parameters' dtype): every gradient is one update stale."""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from xsched.errors import XschedError
from xsched.execute.host_pin import pinned_empty
from xsched.train.host_buckets import (
    Bucket,
    PinnedHome,
    Segment,
    adamw_step,
    chunks,
    export_state,
    import_state,
    load_master,
    make_bucket,
    master_state,
    masters_from_weights,
    sq_norm,
)
from xsched.train.host_share import HostShare, start_shared
from xsched.train.host_tasks import TAKE, UPDATE, TaskQueue, read_ranks

MAX_BUCKET_BYTES = 32 << 20  # a fused step of 8M fp32 values: milliseconds, so a bucket's update ends soon after
MIN_BUCKETS = 8  # a small model gets a few buckets too, so its updates also start during the backward


@dataclass(frozen=True)
class OverlapStats:
    """Worker time (gradients in, norms, AdamW steps; not its waits for the gradients' copies), the part of it
    inside backward passes, and the time the training thread or the plan's lanes waited for the optimizer."""

    optimizer_s: float
    hidden_s: float
    waited_s: float

    @property
    def hidden_share(self) -> float | None:
        return self.hidden_s / self.optimizer_s if self.optimizer_s > 0 else None


class HostAdamW:
    """The listener of a wrapped module (`XschedModule.listen`) that runs AdamW on the parameters' home, the host.

    named: (name, param) in release order (`XschedModule.release_order`); decay: the weight decay of each name;
    bucket_bytes: the size from which a bucket is closed (default: an eighth of the parameters, at most 32 MiB);
    delayed: the one-step delayed update (see the module); clock: a StepClock its buckets' spans and the waits for
    them are reported to; read_order: the names in the order the next forward first reads them (its buckets are
    updated in that order once their gradients are in; default: the reverse of `named`); pin: its host buffers
    the run reads are pinned, each weight's bytes once (`XschedModule.pins_host`, before the module's first run);
    share: the worker's threads and priority (train.host_share; None: as any thread's; `share_note` says what).
    Per optimizer step: `start_step()` before the first forward, `begin(first, last, lr)` before each micro-batch's
    backward, `end_backward()` after it, then `grad_norm()`; `settle()` waits for every update (before reading the
    parameters or the state)."""

    takes_grads = True

    def __init__(
        self,
        named: Sequence[tuple[str, nn.Parameter]],
        decay: Mapping[str, float],
        lr: float,
        bucket_bytes: int | None = None,
        *,
        delayed: bool = False,
        clock: Any = None,
        read_order: Sequence[str] | None = None,
        pin: bool = False,
        share: HostShare | None = None,
    ) -> None:
        if bucket_bytes is None:
            total = sum(p.numel() * p.element_size() for _, p in named)
            bucket_bytes = max(1, min(MAX_BUCKET_BYTES, total // MIN_BUCKETS))
        self.delayed = delayed
        self.pinned = pin  # its host buffers the run reads are pinned (XschedModule.listen checks it)
        self.clock = clock
        self.direct = 0  # gradients the run copied home straight into their buffers
        self.buckets: list[Bucket] = []
        self.of: dict[str, Bucket] = {}
        buckets = chunks(named, bucket_bytes)
        pinned = PinnedHome.sized(buckets, decay) if pin else None
        for k, chunk in enumerate(buckets):
            b = make_bucket(k, chunk, decay, lr, separate=delayed, pinned=pinned)
            self.buckets.append(b)
            self.of.update(dict.fromkeys(b.slots, b))
        self._flags = (True, True, lr)  # this micro-batch: first, last, learning rate
        self._lock = threading.Lock()
        self._cv = threading.Condition(self._lock)
        self._tasks = TaskQueue(read_ranks([list(b.slots) for b in self.buckets], read_order))
        self._norms: dict[str, torch.Tensor | float] = {}  # a GPU's norm (pinned), or a host's squared
        self._norm_out: dict[str, torch.Tensor] = {}  # pinned scalars a GPU's norms are copied home into
        self._urgent: collections.deque[Bucket] = collections.deque()  # write-backs, before any update
        self._error: BaseException | None = None
        self._stop = False
        self._busy_s = self._hidden_s = self._waited_s = 0.0
        self._passes: collections.deque[tuple[float, float]] = collections.deque(maxlen=8)  # the latest steps' runs
        self._open: float | None = None  # the start of the forward and backward under way
        self._thread, self.share_note = start_shared(self._work, "xsched-host-adamw", share)

    # ---- the listener (called from the run's lanes) ----
    def wait(self, name: str) -> None:
        b = self.of.get(name)
        ready = None if b is None else b.readable if self.delayed else b.idle
        if ready is None or ready.is_set():
            self._check()
            return
        t0 = time.perf_counter()
        ready.wait()
        self._waited("read", t0)
        self._check()

    def grad_buffer(self, name: str) -> torch.Tensor | None:
        """Where the run may copy `name`'s gradient home (then handed to `released` as it is): its slice of the
        bucket's gradient buffer, on a step's first micro-batch while no update of the bucket is under way."""
        b = self.of.get(name)
        if b is None or not self._flags[0] or not b.idle.is_set():
            return None
        seg, off, n = b.slots[name]
        return seg.grad[off : off + n]

    def copying(self, name: str, grad: torch.Tensor) -> None:
        """The run is about to copy `name`'s gradient home (on its lane: a GPU's copy stream is current). On a step
        of one micro-batch its norm is taken here, on the gradient's device (a pinned scalar's copy home rides on
        the same stream, before the event the worker waits for), so the worker need not read it again."""
        b = self.of.get(name)
        first, last, _ = self._flags
        if b is None or not (first and last):
            return
        if grad.is_cuda:  # the norm, squared where it is read: a launch fewer per gradient on the issuing thread
            out = self._norm_out.get(name)
            if out is None:
                out = self._norm_out[name] = pinned_empty((), torch.float32)
            out.copy_(torch.linalg.vector_norm(grad, dtype=torch.float32), non_blocking=True)
            value: torch.Tensor | float = out
        elif grad.dtype == torch.float32:
            value = sq_norm(grad.detach().reshape(-1))
        else:
            return  # a low-precision gradient on the host: the worker takes the norm of its fp32 copy
        with self._lock:
            self._norms[name] = value

    def released(self, name: str, grad: torch.Tensor | None, events: Sequence[Any]) -> None:
        b = self.of.get(name)
        if b is None or grad is None:
            return
        first, last, lr = self._flags
        with self._lock:
            if b.done_this_backward or name in b.arrived:
                raise XschedError(
                    f"the gradient of {name} arrived twice in one backward: the host optimizer takes one call of "
                    "the wrapped module per micro-batch",
                    stage="train",
                )
            b.arrived[name] = (grad, events)
            if len(b.arrived) < len(b.slots):
                return
            items, b.arrived, b.done_this_backward = b.arrived, {}, True
            if last and self.delayed and (b.pending or not b.idle.is_set()):
                # this step has read the bucket: the last update may now reach the weights, before anything else
                b.readable.clear()
                if b.idle.is_set():
                    self._urgent.append(b)
                else:
                    b.write_after_step = True
            if last:
                b.idle.clear()
                b.grads_in.clear()
            events = [ev for _, evs in items.values() for ev in evs]
            self._tasks.push(b.index, TAKE, lambda: self._take(b, items, first, last), events)
            if last:
                self._tasks.push(b.index, UPDATE, lambda: self._update(b, lr))
            self._cv.notify()

    # ---- the training loop ----
    def start_step(self) -> None:
        """An optimizer step's first forward starts (the update hides behind the time from here to the end of its
        last backward)."""
        with self._lock:
            self._open = time.perf_counter()

    def begin(self, first: bool, last: bool, lr: float) -> None:
        """A micro-batch's backward starts: the first of a step overwrites the gradients, later ones add to them,
        and the last one's gradients start each bucket's update at rate `lr`."""
        self._check()
        self._flags = (first, last, lr)
        with self._lock:
            self._norms.clear()  # a norm left from a step whose gradient went another way
        for b in self.buckets:
            b.done_this_backward = False
            b.arrived = {}
        with self._lock:
            if self._open is None:
                self._open = time.perf_counter()

    def end_backward(self) -> None:
        """The backward is over: every gradient must have arrived."""
        last = self._flags[1]
        with self._lock:
            if last and self._open is not None:
                self._passes.append((self._open, time.perf_counter()))
                self._open = None
        for b in self.buckets:
            if not b.done_this_backward:
                missing = next(n for n in b.slots if n not in b.arrived)
                raise XschedError(f"the gradient of {missing} did not arrive in the backward", stage="train")

    def grad_norm(self) -> float:
        """The total norm of this step's gradients (waits for them to be in, not for the updates: the worker takes
        every landed gradient before any update)."""
        self._wait_all(lambda b: b.grads_in)
        return sum(b.norm_sq for b in self.buckets) ** 0.5

    def settle(self) -> None:
        """Wait for every update under way (a delayed one stays unwritten: see `flush`)."""
        self._wait_all(lambda b: b.idle)
        self._wait_all(lambda b: b.readable)

    def flush(self) -> None:
        """Settle, then write every delayed update into the parameters (training is over)."""
        self.settle()
        for b in self.buckets:
            if b.pending:
                b.write_back()

    def stats(self) -> OverlapStats:
        with self._lock:
            return OverlapStats(self._busy_s, self._hidden_s, self._waited_s)

    def close(self) -> None:
        """Settle, then stop the worker."""
        try:
            self.settle()
        finally:
            with self._lock:
                self._stop = True
                self._cv.notify()
            self._thread.join()

    # ---- state: torch.optim.AdamW's state dict over the parameters, and the master weights ----
    def export_state(self, facade: torch.optim.Optimizer) -> None:
        """Point `facade` (an AdamW over the same parameters, never stepped) at this optimizer's state."""
        self.settle()
        export_state(self._segments(), facade)

    def import_state(self, facade: torch.optim.Optimizer, names: Mapping[nn.Parameter, str]) -> None:
        """Take the state `facade` loaded (a torch AdamW state dict) into the flat buffers, and empty it."""
        self.settle()
        import_state(self._segments(), facade, names)

    def master(self, names: Mapping[nn.Parameter, str]) -> dict[str, Any]:
        """What a checkpoint keeps beside the parameters: the fp32 master weights where they are kept apart, and
        whether their update is still to be written into the parameters (the delayed update)."""
        self.settle()
        return {"weights": master_state(self._segments(), names), "pending": any(b.pending for b in self.buckets)}

    def busy(self) -> bool:
        """Whether an update or a write-back is under way or due (what `settle` waits for)."""
        return not all(b.idle.is_set() and b.readable.is_set() for b in self.buckets)

    def weights_loaded(self, params: Iterable[nn.Parameter]) -> None:
        """`params` were loaded in place after a settle (execute.state_hooks): their master weights take them."""
        self._check()
        masters_from_weights(self._segments(), params)

    def load_master(self, names: Mapping[nn.Parameter, str], saved: Mapping[str, Any] | None) -> None:
        self.settle()
        load_master(self._segments(), names, (saved or {}).get("weights", {}))
        for b in self.buckets:
            b.pending = bool(saved and saved.get("pending")) and self.delayed

    # ---- the worker ----
    def _take(self, b: Bucket, items: Mapping[str, tuple[torch.Tensor, Sequence[Any]]], first, last) -> None:
        """Gradients into the bucket's fp32 buffers (after their copies finish); on the last micro-batch, their
        norm. Its busy time starts once the copies are over."""
        for _, events in items.values():
            for ev in events:
                ev.synchronize()
        t0 = time.perf_counter()
        for name, (grad, _) in items.items():
            seg, off, n = b.slots[name]
            dst = seg.grad[off : off + n]
            if first and grad.data_ptr() == dst.data_ptr():
                self.direct += 1  # the run copied it home into place
            elif first:
                dst.copy_(grad.reshape(-1))
            else:
                dst.add_(grad.reshape(-1))
        if last:
            made = self._made_norms(items) if first else None
            b.norm_sq = sum(made) if made is not None else sum(sq_norm(s.grad) for s in b.segments)
            b.grads_in.set()
        self._account(f"grads {b.index}", t0)

    def _made_norms(self, names: Iterable[str]) -> list[float] | None:
        """The squared norms `copying` took of these gradients (complete: their copies' events are), or None where
        one is missing."""
        with self._lock:
            got = [self._norms.pop(n, None) for n in names]
        if any(g is None for g in got):
            return None
        return [float(g) ** 2 if isinstance(g, torch.Tensor) else g for g in got]  # type: ignore[misc]

    def _update(self, b: Bucket, lr: float) -> None:
        t0 = time.perf_counter()
        self._step(b, lr)
        self._account(f"bucket {b.index}", t0)

    def _step(self, b: Bucket, lr: float) -> None:
        adamw_step(b.segments, lr)
        if not self.delayed:
            b.write_back()  # bf16 weights from the fp32 master (nothing where they are one)
            b.idle.set()
            return
        with self._lock:  # atomic with `released`'s look at idle: a write-back asked for meanwhile is done here
            due, b.write_after_step = b.write_after_step, False
            b.pending = True
            if not due:
                b.idle.set()
        if due:
            b.write_back()
            b.readable.set()
            b.idle.set()

    def _write(self, b: Bucket) -> None:
        t0 = time.perf_counter()
        b.write_back()
        b.readable.set()
        self._account(f"write-back {b.index}", t0)

    def _account(self, label: str, t0: float) -> None:
        t1 = time.perf_counter()
        with self._lock:
            passes = [*self._passes, *([(self._open, t1)] if self._open is not None else [])]
            self._busy_s += t1 - t0
            self._hidden_s += sum(max(0.0, min(t1, e) - max(t0, s)) for s, e in passes)
        if self.clock is not None:
            self.clock.span("optimizer", label, t0, t1)

    def _waited(self, what: str, t0: float) -> None:
        t1 = time.perf_counter()
        with self._lock:
            self._waited_s += t1 - t0
        if self.clock is not None:
            self.clock.waited(what, t0, t1)

    def _work(self) -> None:
        torch.set_grad_enabled(False)
        while True:
            with self._lock:
                while not (self._tasks or self._urgent or self._stop):
                    self._cv.wait()
                if self._urgent:
                    b = self._urgent.popleft()
                    task: Callable[[], None] = lambda b=b: self._write(b)  # noqa: E731
                elif self._tasks:
                    task = self._tasks.pop().run
                else:
                    return
            try:
                if self._error is None:
                    task()
            except BaseException as e:  # reported to the training thread; every waiter is woken
                self._error = e
                for b in self.buckets:
                    b.idle.set()
                    b.grads_in.set()
                    b.readable.set()

    def _check(self) -> None:
        if self._error is not None:
            e = self._error
            raise XschedError(f"the host optimizer failed: {type(e).__name__}: {e}", stage="train") from e

    def _wait_all(self, event: Callable[[Bucket], threading.Event]) -> None:
        t0 = time.perf_counter()
        for b in self.buckets:
            event(b).wait()
        self._waited("step", t0)
        self._check()

    def _segments(self) -> Iterable[Segment]:
        return (s for b in self.buckets for s in b.segments)
