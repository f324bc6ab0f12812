"""The steps that release and refill an output the caller holds (`contracts.holds.held_steps`): a release empties
the storage the caller holds in place (`untyped_storage().resize_(0)`, as FSDP2 frees unsharded parameters), and a
refill gives it its bytes back and writes the value into it, by a copy from a store or by the op's `out=` form, so
the caller's tensor holds the value again when the step returns. Between them the caller's tensor has no bytes:
code that reads it inside the backward (a hook on another tensor) fails there."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from xsched.contracts.holds import into_target
from xsched.contracts.plan import Compute, Copy, Free
from xsched.execute.compiled import compile_op
from xsched.execute.steps import RunState, StepFn, pinned


def prepare_held(ex: Any, i: int, kind: str, s: Any) -> StepFn:
    """Step `i` of `ex`'s plan, a release or a refill of a held output."""
    if kind == "release":
        assert isinstance(s, Free)
        return _release(s)
    if isinstance(s, Copy):
        return _refill_copy(ex, s)
    assert isinstance(s, Compute)
    return _refill_compute(ex, s)


def _release(s: Free) -> StepFn:
    v, d = s.value, s.device

    def release(st: RunState) -> None:
        t = st.stores[d].drop(v)
        assert t is not None
        storage = t.untyped_storage()
        if not storage.resizable():  # memory it does not own (from_numpy, say): kept, as any held tensor's free
            st.released[(v, d)] = (t, -1)
            return
        st.released[(v, d)] = (t, storage.nbytes())
        storage.resize_(0)

    return release


def _refilled(st: RunState, v: str, d: str) -> torch.Tensor:
    """The caller's tensor of `v` on `d`, its storage given its bytes back (contents undefined until written)."""
    t, n = st.released.pop((v, d))
    if n >= 0:
        t.untyped_storage().resize_(n)
    return t


def _refill_copy(ex: Any, s: Copy) -> StepFn:
    v, src, dst = s.value, s.src, s.dst
    to_gpu = ex.dev[dst].type == "cuda"
    reader = ex.compute_stream(dst) if to_gpu else None

    def refill(st: RunState) -> None:
        t = _refilled(st, v, dst)
        x = st.stores[src].tensors[v]
        if to_gpu:
            x = pinned(x, st) if x.device.type == "cpu" else x
            t.copy_(x, non_blocking=True)
            if torch.cuda.current_stream(t.device) != reader:
                t.record_stream(reader)  # the compute stream reads it next: its block is not reused before
        else:
            t.copy_(x)
        st.stores[dst].put(v, t)

    return refill


def _refill_compute(ex: Any, s: Compute) -> StepFn:
    op = ex.graph.op[s.op]
    (v,) = op.outputs
    d = s.device
    call = dict(op.call or {})
    call["kwargs"] = {**call.get("kwargs", {}), "out": {"ref": v}}
    kernel = compile_op(dataclasses.replace(op, call=call), ex.dev[d], target=into_target(op.target))

    def refill(st: RunState) -> None:
        store = st.stores[d]
        store.put(v, _refilled(st, v, d))  # the kernel writes into it (its `out`), as the plan counts the make
        kernel(store.tensors)

    return refill


def poison_released(st: RunState) -> None:
    """A run that stopped between a release and its refill: each caller's tensor left empty gets its bytes back,
    filled with NaN (or its dtype's largest value), so that reading it gives visibly wrong numbers, not a read
    past an empty storage."""
    for t, n in st.released.values():
        if n < 0:  # never emptied
            continue
        t.untyped_storage().resize_(n)
        t.fill_(_poison(t.dtype))
    st.released.clear()


def _poison(dtype: torch.dtype) -> float | int | bool:
    """What fills a tensor whose value was lost: NaN, else the dtype's largest value (True for bool)."""
    if dtype.is_floating_point or dtype.is_complex:
        return float("nan")
    return True if dtype == torch.bool else torch.iinfo(dtype).max
