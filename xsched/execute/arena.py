"""Planned addresses at run time: one preallocated byte buffer (the arena) per device, every value the plan places in
it (xsched.allocator.placement's ArenaPlan: which values, their slots and offsets) a view at its planned offset,
written by its op's `out=` variant (placement.arena_kernel: our rewrite where that is PyTorch's composite) or by the
copy that brings it there.

Safety across CUDA streams (record_stream no longer protects the arena's memory): a slot's next occupant is written
by a step that allocates on its device, a compute or a copy into it, and lanes.step_waits makes every such step wait
for every earlier free on the device (directly, or through a wait that implies it). Greedy and CP-SAT only reuse a
slot whose previous occupant was freed at an earlier step, so that free is among them. Each free waits for every
read of its value since it was made (computes and copies out, on any lane; a read another implies, through the one
that implies it), and the free lane hands those reads' CUDA events on (workers.Lane.finished), so the writing stream
waits on the GPU for the previous occupant's last readers before it writes (an event of a stream that waited for
another's is after it). A free run inline on the compute lane is ordered by the compute stream itself.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from xsched.allocator.addresses import Residency, residencies
from xsched.allocator.placement import ArenaPlan, arena_kernel, slot_bytes, value_dtype
from xsched.contracts.device_dtypes import agrees
from xsched.contracts.graph import Graph
from xsched.contracts.layout import layout
from xsched.contracts.plan import Compute, Copy, Plan
from xsched.contracts.torch_ops import laid_out
from xsched.errors import XschedError
from xsched.execute.compiled import _direct, _has_ref, getter, with_rng
from xsched.execute.steps import RunState, StepFn, pinned, prepare_compute, prepare_copy
from xsched.interpret import wrong_size


class Arena:
    """The buffers of an ArenaPlan on real devices (one uint8 tensor per device with placed values, allocated once)
    and each placed residency's view: `slots[(value, device, start step)]`."""

    def __init__(
        self,
        graph: Graph,
        plan: Plan,
        dev: Mapping[str, torch.device],
        watch: frozenset[str] = frozenset(),
        handed: bool = True,
    ):
        self.planned = ArenaPlan(graph, plan, watch, handed=handed)
        a = self.planned.addresses
        gpu = any(t.type == "cuda" for t in dev.values())
        self.buffers = {
            d: torch.empty(n, dtype=torch.uint8, device=dev[d], pin_memory=gpu and dev[d].type == "cpu")
            for d, n in a.arena_bytes.items()
            if n > 0
        }
        self.slots: dict[tuple[str, str, int], torch.Tensor] = {}
        for key, off in a.offsets.items():
            v = graph.value[key[0]]
            dt, (stride, offset) = value_dtype(v), layout(v)
            raw = self.buffers[key[1]][off : off + slot_bytes(v)].view(dt)  # type: ignore[arg-type]
            # as_strided's offset counts from the buffer's start, not the slice's
            self.slots[key] = raw.as_strided(tuple(v.shape or ()), stride, raw.storage_offset() + offset)

    def base(self, device: str) -> int:
        return self.buffers[device].data_ptr()


def prepare_arena_compute(ex: Any, i: int, s: Compute) -> StepFn:
    """A compute whose outputs the arena holds: its op's `out=` overload writing into their slots; otherwise the
    executor's own compute step."""
    op, dev, d = ex.graph.op[s.op], ex.dev[s.device], s.device
    # an op whose kernel here makes another dtype than the graph's (contracts.device_dtypes) runs as made and cast:
    # its out= overload refuses the graph's dtype; its slots stay unused
    if i not in ex.arena.planned.compute_steps or not agrees(ex.graph, op, dev.type):
        return prepare_compute(ex, i, s)
    fn, names = arena_kernel(op.target, ex.arena.planned.composites)  # type: ignore[misc]
    fn = _direct(fn)
    spec = op.call or {}
    args = [getter(a, dev) for a in spec.get("args", [])]
    kw = spec.get("kwargs", {})
    consts = {k: getter(x, dev)(None) for k, x in kw.items() if not _has_ref(x)}
    refs = [(k, getter(x, dev)) for k, x in kw.items() if _has_ref(x)]
    slots = [ex.arena.slots.get((v, d, i)) for v in op.outputs]
    fresh = [(names[j], ex.graph.value[v]) for j, (v, t) in enumerate(zip(op.outputs, slots)) if t is None]
    consts.update({k: t for k, t in zip(names, slots) if t is not None})
    placed = [
        (v, names[j], t, t.data_ptr() if t is not None else 0, v in ex.watch)
        for j, (v, t) in enumerate(zip(op.outputs, slots))
    ]

    def kernel(store_outs: tuple[Any, dict[str, torch.Tensor]]) -> tuple:
        T, outs = store_outs
        fn(*[a(T) for a in args], **consts, **outs, **{k: g(T) for k, g in refs})
        return ()

    # a random op: the generator's lock, and the first run's state replayed by a recomputation (compiled.with_rng)
    drawn = with_rng(op, kernel, dev, record=op.id in ex.recomputed_random) if op.id in ex.random else None

    def new_storage(numel: int, dtype: torch.dtype) -> torch.Tensor:  # an output not placed: a fresh tensor (laid_out)
        return torch.empty(numel, dtype=dtype, device=dev)

    def compute(st: RunState) -> None:
        store = st.stores[d]
        outs = {k: laid_out(v, new_storage)[1] for k, v in fresh} if fresh else {}
        try:
            if drawn is not None:
                drawn((store.tensors, outs), st.rng)
            else:
                kernel((store.tensors, outs))
        except KeyError as e:
            raise XschedError("input value is not available", stage="execute", op=op.id, value=str(e.args[0])) from e
        except (RuntimeError, TypeError, ValueError, IndexError) as e:
            raise XschedError(f"{op.target} failed: {e}", stage="execute", op=op.id, device=str(dev)) from e
        for v, k, slot, ptr, watched in placed:
            t = outs[k] if slot is None else slot
            if t.nbytes != ex.nbytes[v] or (slot is not None and t.data_ptr() != ptr):  # resized by its kernel
                raise wrong_size(op, v, t.nbytes, ex.nbytes[v], d)
            store.put(v, t)
            if watched:
                st.first.setdefault(v, t)

    return compute


def prepare_arena_copy(ex: Any, i: int, s: Copy) -> StepFn:
    """A copy into the arena: the source written into the value's slot (on the lane's stream on CUDA, a pageable
    host source staged through pinned memory first); otherwise the executor's own copy step."""
    if i not in ex.arena.planned.copy_steps:
        return prepare_copy(ex, i, s)
    slot = ex.arena.slots[(s.value, s.dst, i)]
    v, src, dst = s.value, s.src, s.dst
    gpu = ex.dev[src].type == "cuda" or ex.dev[dst].type == "cuda"

    def copy(st: RunState) -> None:
        t = st.stores[src].tensors[v]
        if gpu:
            if t.device.type == "cuda":  # an outside source the caching allocator must keep for this stream
                t.record_stream(torch.cuda.current_stream(t.device))
            elif slot.device.type == "cuda":
                t = pinned(t, st)
        slot.copy_(t, non_blocking=gpu)
        st.stores[dst].put(v, slot)

    return copy


# the step kinds of a run with planned addresses (Executor(planned_addresses=True)); frees only drop the reference
ARENA_KINDS = {Compute: prepare_arena_compute, Copy: prepare_arena_copy}


def placed_residencies(arena: Arena) -> list[Residency]:
    """The residencies the arena holds, in the order they begin."""
    keys = arena.planned.addresses.offsets
    return [r for r in residencies(arena.planned.graph, arena.planned.plan) if r.key in keys]
