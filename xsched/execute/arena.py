"""Planned addresses at run time: one preallocated byte buffer (the arena) per device, every value the plan places in
it (xsched.allocator.addresses) a view at its planned offset, written by its op's `out=` variant or by the copy that
brings it there.

What runs in the arena: computes whose op has an `out=` overload taking the same arguments (every return a
keyword-only written alias), random ops included (the in-place twin eager runs on a fresh tensor, run on the slot,
draws replayed as without planned addresses), with at least one output placed (the others written into fresh
tensors outside); copies into a device. Outside it, as without planned addresses: graph inputs homed on the device;
where the caller is handed the forward outputs at the autograd boundary (wrap), values still resident at the end and
graph outputs live across the boundary (the caller may hold them past the step; in whole-step runs they are placed,
valid until the next run, as a CUDA graph's outputs); watched values (the caller keeps their first tensor); every
value an aliasing op reads or makes (a view would outlive its slot's occupant); outputs whose recorded layout
overlaps itself (no `out=` can write it); ops without an `out=` variant. In-place reuse (compiled.reusable_inputs) is
off: an in-place output would live in its input's slot past that input's free.

Safety across CUDA streams (record_stream no longer protects the arena's memory): a slot's next occupant is written
by a step that allocates on its device, a compute or a copy into it, and lanes.step_waits makes every such step wait
for every earlier free on the device. Greedy and CP-SAT only reuse a slot whose previous occupant was freed at an
earlier step, so that free is among them. Each free waits for every read of its value since it was made (computes
and copies out, on any lane), and the free lane hands those reads' CUDA events on (workers.Lane.finished), so the
writing stream waits on the GPU for the previous occupant's last readers before it writes. A free run inline on the
compute lane is ordered by the compute stream itself.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import torch

from xsched.allocator.addresses import Addresses, Residency, plan_addresses, residencies
from xsched.contracts.graph import Graph, Value
from xsched.contracts.layout import layout, storage_numel
from xsched.contracts.plan import Compute, Copy, Plan
from xsched.contracts.torch_ops import _FillFresh, laid_out, resolve
from xsched.errors import XschedError
from xsched.execute.compiled import _aliases, _direct, _has_ref, getter, with_rng
from xsched.execute.steps import RunState, StepFn, pinned, prepare_compute, prepare_copy
from xsched.interpret import wrong_size

# ops that only make uninitialised memory: their slot (laid out as the value records) is that memory
_EMPTY = frozenset({"aten.empty_like.default", "aten.empty.memory_format", "aten.empty_strided.default"})


@functools.cache
def out_variant(target: str) -> tuple[Any, tuple[str, ...]] | None:
    """The `out=` overload of op `target` and its out arguments, one per return in order: an overload of the same
    packet whose arguments are the op's (same names, types, kinds and order) followed by keyword-only written
    aliases, one per return. None when the op has none (or is not an aten operator)."""
    if target in _EMPTY:
        return (lambda *args, out, **kwargs: out), ("out",)
    try:
        fn = resolve(target)
        if isinstance(fn, _FillFresh):  # a random op eager runs in place on a fresh tensor: the slot is that tensor
            inplace = fn.inplace
            return (lambda x, *args, out, **kwargs: inplace(out, *args, **kwargs)), ("out",)
        schema = fn._schema
        packet = fn._overloadpacket
    except (XschedError, AttributeError):
        return None
    if not schema.returns or any(r.alias_info is not None or str(r.type) != "Tensor" for r in schema.returns):
        return None
    want = [(a.name, str(a.type), a.kwarg_only) for a in schema.arguments]
    for name in packet.overloads():
        cand = getattr(packet, name)._schema
        head, tail = cand.arguments[: len(want)], cand.arguments[len(want) :]
        if [(a.name, str(a.type), a.kwarg_only) for a in head] != want or len(tail) != len(schema.returns):
            continue
        written = [a for a in tail if a.kwarg_only and a.alias_info is not None and a.alias_info.is_write]
        returned = [r.alias_info for r in cand.returns]
        if len(written) == len(tail) == len(returned) and all(
            r is not None and r.before_set == a.alias_info.before_set for a, r in zip(written, returned)
        ):
            return getattr(packet, name), tuple(a.name for a in tail)
    return None


def _dtype(v: Value) -> torch.dtype | None:
    dt = getattr(torch, v.dtype or "", None)
    return dt if isinstance(dt, torch.dtype) else None


def writable(v: Value) -> bool:
    """True when a tensor laid out as `v` records (shape, strides) can be written: no two elements share memory."""
    if v.shape is None or _dtype(v) is None:
        return False
    stride, _ = layout(v)
    reach = 0  # the furthest element offset the dims taken so far reach
    for size, st in sorted(((n, s) for n, s in zip(v.shape, stride) if n > 1), key=lambda x: x[1]):
        if st <= reach:
            return False
        reach += (size - 1) * st
    return True


def slot_bytes(v: Value) -> int:
    """Bytes of storage a tensor laid out as `v` records spans (its storage offset included)."""
    stride, offset = layout(v)
    return storage_numel(v.shape or (), stride, offset) * _dtype(v).itemsize  # type: ignore[union-attr]


class ArenaPlan:
    """Which residencies of `plan` run in the arena (the rules in the module's docstring) and their addresses. Needs
    op schemas, not devices: it sizes plans of graphs captured elsewhere (scripts/bench_reserved_model.py)."""

    def __init__(
        self,
        graph: Graph,
        plan: Plan,
        watch: frozenset[str] = frozenset(),
        time_limit_s: float = 0.0,
        handed: bool = True,
    ):
        self.graph, self.plan = graph, plan
        self.handed = handed  # the caller is handed the forward outputs at the autograd boundary (wrap)
        aliased = {v for o in graph.ops if _aliases(o) for v in (*o.inputs, *o.outputs)}
        self.outputs = frozenset(graph.outputs)
        self.ends = {r.key: r.end for r in residencies(graph, plan)}
        self.placeable = {
            v.id
            for v in graph.values
            if v.id not in aliased and v.id not in watch and v.nbytes > 0 and writable(v) and slot_bytes(v) > 0
        }
        self.compute_steps: set[int] = set()  # compute steps that write their outputs into the arena
        self.copy_steps: set[int] = set()  # copies that write into the arena
        keys: set[tuple[str, str, int]] = set()  # the residencies placed
        for i, s in enumerate(plan.steps):
            if isinstance(s, Compute):
                op = graph.op[s.op]
                found = out_variant(op.target)
                paths = [tuple(p) for p in (op.call or {}).get("outs", ())]
                regular = paths == ([()] if len(paths) == 1 else [(j,) for j in range(len(paths))])
                if found is None or not regular or len(paths) != len(found[1]) or len(op.outputs) != len(paths):
                    continue
                # outputs not placed (graph outputs, gradients) are written into fresh tensors of their layout
                fit = [(v, s.device, i) for v in op.outputs if self._fits(v, s.device, i)]
                if fit and all(writable(graph.value[v]) for v in op.outputs):
                    self.compute_steps.add(i)
                    keys.update(fit)
            elif isinstance(s, Copy) and self._fits(s.value, s.dst, i):
                self.copy_steps.add(i)
                keys.add((s.value, s.dst, i))
        self.addresses: Addresses = plan_addresses(
            graph,
            plan,
            lambda r: r.key in keys,
            {v: slot_bytes(graph.value[v]) for v in self.placeable},
            time_limit_s=time_limit_s,
            to_the_end=not handed,
        )

    def _fits(self, v: str, d: str, i: int) -> bool:
        """Whether the residency of `v` on `d` that step `i` begins may live in the arena: placeable, and where the
        caller is handed the forward outputs at the autograd boundary (and may hold them past their free), freed during
        the step and, for a graph output, not live across the boundary. In whole-step runs (not `handed`) every
        residency begun during the step may: what is still resident at the end is read before the next run."""
        if v not in self.placeable:
            return False
        if not self.handed:
            return True
        end = self.ends.get((v, d, i), len(self.plan.steps))
        b = self.plan.boundary
        return end < len(self.plan.steps) and (v not in self.outputs or b is None or not i < b <= end)

    def outside_bytes(self) -> dict[str, int]:
        """Per device: bytes made during the step outside the arena (every residency, summed), the share a report
        gives beside the arena's."""
        out: dict[str, int] = {}
        for r in residencies(self.graph, self.plan):
            if r.start >= 0 and r.key not in self.addresses.offsets:
                out[r.device] = out.get(r.device, 0) + r.nbytes
        return out


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
            dt, (stride, offset) = _dtype(v), layout(v)
            raw = self.buffers[key[1]][off : off + slot_bytes(v)].view(dt)  # type: ignore[arg-type]
            # as_strided's offset counts from the buffer's start, not the slice's
            self.slots[key] = raw.as_strided(tuple(v.shape or ()), stride, raw.storage_offset() + offset)

    def base(self, device: str) -> int:
        return self.buffers[device].data_ptr()


def prepare_arena_compute(ex: Any, i: int, s: Compute) -> StepFn:
    """A compute whose outputs the arena holds: its op's `out=` overload writing into their slots; otherwise the
    executor's own compute step."""
    if i not in ex.arena.planned.compute_steps:
        return prepare_compute(ex, i, s)
    op, dev, d = ex.graph.op[s.op], ex.dev[s.device], s.device
    fn, names = out_variant(op.target)  # type: ignore[misc]
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
