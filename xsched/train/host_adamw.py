"""AdamW on the host, overlapped with the backward: the trained parameters packed into flat buckets in the order the
plan's backward releases them, each bucket's fused CPU AdamW step run by a worker thread as soon as all of its
gradients have arrived, and a later read of a parameter waiting for its own bucket only. Its state reads and loads
as torch.optim.AdamW's state dict over the parameters, so checkpoints resume across either optimizer."""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from xsched.errors import XschedError

MAX_BUCKET_BYTES = 32 << 20  # a fused step of 8M fp32 values: milliseconds, so a bucket's update ends soon after
MIN_BUCKETS = 8  # a small model gets a few buckets too, so its updates also start during the backward


@dataclass
class _Segment:
    """Parameters of one bucket that share a weight decay and dtype: views into one flat buffer, stepped as one."""

    params: list[nn.Parameter]
    flat: torch.Tensor
    grad: torch.Tensor
    opt: torch.optim.AdamW
    spans: list[tuple[int, int]]  # (offset, numel) of each param in the flat buffers


@dataclass
class _Bucket:
    segments: list[_Segment]
    slots: dict[str, tuple[_Segment, int, int]]  # param name -> its segment, offset, numel
    arrived: dict[str, tuple[torch.Tensor, Sequence[Any]]] = field(default_factory=dict)
    done_this_backward: bool = False
    idle: threading.Event = field(default_factory=threading.Event)  # set: no update of it under way
    grads_in: threading.Event = field(default_factory=threading.Event)  # set: this step's gradients are in
    norm_sq: float = 0.0


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
    bucket_bytes: the size from which a bucket is closed (default: an eighth of the parameters, at most 32 MiB).
    Per optimizer step: `begin(first, last, lr)` before each micro-batch's backward, `end_backward()` after it,
    then `grad_norm()`; `settle()` waits for every update (before reading the parameters or the state)."""

    takes_grads = True

    def __init__(
        self,
        named: Sequence[tuple[str, nn.Parameter]],
        decay: Mapping[str, float],
        lr: float,
        bucket_bytes: int | None = None,
    ) -> None:
        if bucket_bytes is None:
            total = sum(p.numel() * p.element_size() for _, p in named)
            bucket_bytes = max(1, min(MAX_BUCKET_BYTES, total // MIN_BUCKETS))
        self.buckets: list[_Bucket] = []
        self.of: dict[str, _Bucket] = {}
        for chunk in _chunks(named, bucket_bytes):
            b = _bucket(chunk, decay, lr)
            b.idle.set()
            b.grads_in.set()
            self.buckets.append(b)
            self.of.update(dict.fromkeys(b.slots, b))
        self._flags = (True, True, lr)  # this micro-batch: first, last, learning rate
        self._lock = threading.Lock()
        self._cv = threading.Condition(self._lock)
        self._tasks: collections.deque[Callable[[], None]] = collections.deque()  # in the order buckets complete
        self._error: BaseException | None = None
        self._stop = False
        self._busy_s = self._hidden_s = self._waited_s = 0.0
        self._backward: collections.deque[tuple[float, float]] = collections.deque(maxlen=8)  # the latest passes
        self._open: float | None = None  # the start of the backward under way
        self._thread = threading.Thread(target=self._work, name="xsched-host-adamw", daemon=True)
        self._thread.start()

    # ---- the listener (called from the run's lanes) ----
    def wait(self, name: str) -> None:
        b = self.of.get(name)
        if b is None or b.idle.is_set():
            self._check()
            return
        t0 = time.perf_counter()
        b.idle.wait()
        with self._lock:
            self._waited_s += time.perf_counter() - t0
        self._check()

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
            if last:
                b.idle.clear()
                b.grads_in.clear()
            self._tasks.append(lambda: self._take(b, items, first, last, lr))
            self._cv.notify()

    # ---- the training loop ----
    def begin(self, first: bool, last: bool, lr: float) -> None:
        """A micro-batch's backward starts: the first of a step overwrites the gradients, later ones add to them,
        and the last one's gradients start each bucket's update at rate `lr`."""
        self._check()
        self._flags = (first, last, lr)
        for b in self.buckets:
            b.done_this_backward = False
            b.arrived = {}
        with self._lock:
            self._open = time.perf_counter()

    def end_backward(self) -> None:
        """The backward is over: every gradient must have arrived."""
        with self._lock:
            if self._open is not None:
                self._backward.append((self._open, time.perf_counter()))
            self._open = None
        for b in self.buckets:
            if not b.done_this_backward:
                missing = next(n for n in b.slots if n not in b.arrived)
                raise XschedError(f"the gradient of {missing} did not arrive in the backward", stage="train")

    def grad_norm(self) -> float:
        """The total norm of this step's gradients (waits for them to be in, and so for the updates queued before
        the last bucket's)."""
        self._wait_all(lambda b: b.grads_in)
        return sum(b.norm_sq for b in self.buckets) ** 0.5

    def settle(self) -> None:
        """Wait for every update under way."""
        self._wait_all(lambda b: b.idle)

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

    # ---- state: torch.optim.AdamW's state dict over the parameters ----
    def export_state(self, facade: torch.optim.Optimizer) -> None:
        """Point `facade` (an AdamW over the same parameters, never stepped) at this optimizer's state: views into
        the flat buffers, saved by torch.save as one storage per buffer."""
        self.settle()
        for seg in self._segments():
            st = seg.opt.state.get(seg.flat)
            if not st:
                continue
            for p, (off, n) in zip(seg.params, seg.spans):
                facade.state[p] = {
                    "step": st["step"].clone(),  # its own: torch's for-loop AdamW steps a loaded "step" in place
                    "exp_avg": st["exp_avg"][off : off + n].view(p.shape),
                    "exp_avg_sq": st["exp_avg_sq"][off : off + n].view(p.shape),
                }

    def import_state(self, facade: torch.optim.Optimizer, names: Mapping[nn.Parameter, str]) -> None:
        """Take the state `facade` loaded (a torch AdamW state dict) into the flat buffers, and empty it."""
        self.settle()
        group_of = {p: g for g in facade.param_groups for p in g["params"]}
        for seg in self._segments():
            states = [facade.state.get(p) for p in seg.params]
            seg.opt.state.clear()
            if all(not s for s in states):
                continue
            steps = {float(s["step"]) if s else None for s in states}
            if len(steps) != 1:
                raise XschedError(
                    f"the optimizer state gives the parameters {', '.join(names[p] for p in seg.params)} different "
                    f"step counts {sorted(steps, key=str)}; the host optimizer steps them together",
                    stage="train",
                )
            exp_avg, exp_avg_sq = torch.empty_like(seg.flat), torch.empty_like(seg.flat)
            for s, (off, n) in zip(states, seg.spans):
                exp_avg[off : off + n].copy_(s["exp_avg"].reshape(-1))
                exp_avg_sq[off : off + n].copy_(s["exp_avg_sq"].reshape(-1))
            step = torch.tensor(steps.pop(), dtype=torch.float32, device=seg.flat.device)
            seg.opt.state[seg.flat] = {"step": step, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
            group = group_of[seg.params[0]]
            for key in ("betas", "eps", "weight_decay"):
                seg.opt.param_groups[0][key] = group[key]
        facade.state.clear()

    # ---- the worker ----
    def _take(self, b: _Bucket, items: Mapping[str, tuple[torch.Tensor, Sequence[Any]]], first, last, lr) -> None:
        """Gradients into the bucket's flat buffers (after their copies finish); on the last micro-batch, their
        norm, then the bucket's update. Its busy time starts once the copies are over."""
        for _, events in items.values():
            for ev in events:
                ev.synchronize()
        t0 = time.perf_counter()
        for name, (grad, _) in items.items():
            seg, off, n = b.slots[name]
            dst = seg.grad[off : off + n]
            if first:
                dst.copy_(grad.reshape(-1))
            else:
                dst.add_(grad.reshape(-1))
        if last:
            self._step(b, lr)
        t1 = time.perf_counter()
        with self._lock:
            passes = [*self._backward, *([(self._open, t1)] if self._open is not None else [])]
            self._busy_s += t1 - t0
            self._hidden_s += sum(max(0.0, min(t1, e) - max(t0, s)) for s, e in passes)

    def _step(self, b: _Bucket, lr: float) -> None:
        b.norm_sq = sum(float(torch.linalg.vector_norm(s.grad)) ** 2 for s in b.segments)
        b.grads_in.set()
        for seg in b.segments:
            seg.opt.param_groups[0]["lr"] = lr
            seg.opt.step()
        b.idle.set()

    def _work(self) -> None:
        torch.set_grad_enabled(False)
        while True:
            with self._lock:
                while not (self._tasks or self._stop):
                    self._cv.wait()
                if not self._tasks:
                    return
                task = self._tasks.popleft()
            try:
                if self._error is None:
                    task()
            except BaseException as e:  # reported to the training thread; every waiter is woken
                self._error = e
                for b in self.buckets:
                    b.idle.set()
                    b.grads_in.set()

    def _check(self) -> None:
        if self._error is not None:
            e = self._error
            raise XschedError(f"the host optimizer failed: {type(e).__name__}: {e}", stage="train") from e

    def _wait_all(self, event: Callable[[_Bucket], threading.Event]) -> None:
        t0 = time.perf_counter()
        for b in self.buckets:
            event(b).wait()
        with self._lock:
            self._waited_s += time.perf_counter() - t0
        self._check()

    def _segments(self) -> Iterable[_Segment]:
        return (s for b in self.buckets for s in b.segments)


def _chunks(named: Sequence[tuple[str, nn.Parameter]], limit: int) -> list[list[tuple[str, nn.Parameter]]]:
    """Consecutive runs of `named` of at least `limit` bytes each (the last may be smaller)."""
    out: list[list[tuple[str, nn.Parameter]]] = []
    size = limit
    for n, p in named:
        if size >= limit:
            out.append([])
            size = 0
        out[-1].append((n, p))
        size += p.numel() * p.element_size()
    return out


def _bucket(chunk: Sequence[tuple[str, nn.Parameter]], decay: Mapping[str, float], lr: float) -> _Bucket:
    """Pack the chunk's parameters into one flat buffer per (weight decay, dtype): each parameter becomes a view."""
    keys: dict[tuple[float, torch.dtype], list[tuple[str, nn.Parameter]]] = {}
    for n, p in chunk:
        keys.setdefault((decay[n], p.dtype), []).append((n, p))
    segments, slots = [], {}
    for (wd, dtype), members in keys.items():
        device = members[0][1].device
        pinned = members[0][1].is_pinned()
        total = sum(p.numel() for _, p in members)
        flat = torch.empty(total, dtype=dtype, device=device, pin_memory=pinned)
        spans, off = [], 0
        with torch.no_grad():
            for _, p in members:
                flat[off : off + p.numel()].copy_(p.detach().reshape(-1))
                p.data = flat[off : off + p.numel()].view(p.shape)
                spans.append((off, p.numel()))
                off += p.numel()
        grad = torch.zeros_like(flat)
        seg = _Segment([p for _, p in members], flat, grad, _adamw(flat, lr, wd), spans)
        flat.grad = grad
        segments.append(seg)
        slots.update({n: (seg, o, k) for (n, _), (o, k) in zip(members, spans)})
    return _Bucket(segments, slots)


def _adamw(flat: torch.Tensor, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """torch's fused AdamW over one flat buffer (one kernel per step), foreach where fused is not built."""
    try:
        return torch.optim.AdamW([flat], lr=lr, weight_decay=weight_decay, fused=True)
    except RuntimeError:
        return torch.optim.AdamW([flat], lr=lr, weight_decay=weight_decay, foreach=True)
