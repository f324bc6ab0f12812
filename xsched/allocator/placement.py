"""Which values of a plan run in the arena of planned addresses, their slots' bytes and offsets (ArenaPlan): read from
the graph, the plan and torch's op schemas, no device needed, so the executor (xsched.execute.arena) runs it and
`--explain` and the report size it from the same selection.

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

Many `out=` overloads are PyTorch's generated composites (native_dropout, layer norm, clone, masked_fill, ...): the
functional op into fresh tensors, then a copy into `out`. Where the functional form is itself a kernel that can write
the slot (a copy, a select, an `out=` with a Scalar wrapped), the arena runs that (_rewrites). The others are run as
without planned addresses, outside the arena, unless placing them (their temporaries and copies beside the arena,
counted as scratch) makes the smaller predicted peak for the plan: ArenaPlan sizes both and keeps the smaller. An
op's workspace (scratch it allocates inside) is never in the arena and counts outside it during its step.

torch is imported only for graphs whose values record a dtype and shape (captured from PyTorch): planning and
reporting on imported graph files stay torch-free.
"""

from __future__ import annotations

import functools
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from xsched.allocator.addresses import Addresses, plan_addresses, residencies
from xsched.allocator.replay import op_workspace
from xsched.contracts.graph import Graph, Op, Value
from xsched.contracts.layout import layout, storage_numel
from xsched.contracts.plan import Compute, Copy, Plan
from xsched.contracts.profile import Profile
from xsched.errors import XschedError

if TYPE_CHECKING:
    import torch

# ops that only make uninitialised memory: their slot (laid out as the value records) is that memory
_EMPTY = frozenset({"aten.empty_like.default", "aten.empty.memory_format", "aten.empty_strided.default"})


@functools.cache
def out_variant(target: str) -> tuple[Any, tuple[str, ...]] | None:
    """The `out=` overload of op `target` and its out arguments, one per return in order: an overload of the same
    packet whose arguments are the op's (same names, types, kinds and order) followed by keyword-only written
    aliases, one per return. None when the op has none (or is not an aten operator)."""
    if target in _EMPTY:
        return (lambda *args, out, **kwargs: out), ("out",)
    if not target.startswith("aten."):  # only aten operators have out= overloads (and no torch import for others)
        return None
    from xsched.contracts.torch_ops import _FillFresh, resolve

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


# ops whose `out=` overload is PyTorch's generated composite (the functional op, then a copy into `out`) but whose
# functional form is an `out=` kernel with its Scalar wrapped as a tensor, a copy, or a select: the arena runs that
# on the slot, no temporary, no second copy, bit for bit what eager computes (CPU's native_dropout_backward is
# grad * mask * scale, CUDA's masked_scale kernel the same in float: mask is 0 or 1)
@functools.cache
def _rewrites() -> dict[str, Any]:
    import torch

    return {
        "aten.clone.default": lambda x, *, out, memory_format=None: out.copy_(x),
        "aten.copy.default": lambda x, src, non_blocking=False, *, out: out.copy_(src, non_blocking=non_blocking),
        "aten.relu.default": lambda x, *, out: torch.clamp_min(x, 0, out=out),  # eager's relu is clamp_min(x, 0)
        # one pass, as eager's in-place masked_fill_ on a dying input (functional masked_fill clones first): the
        # value cast to x's dtype as masked_fill casts it (on x's device: no CPU scalar for a CUDA kernel), x's
        # elements kept bit for bit
        "aten.masked_fill.Scalar": lambda x, mask, value, *, out: torch.where(
            mask, torch.scalar_tensor(value, dtype=x.dtype, device=x.device), x, out=out
        ),
        "aten.masked_fill.Tensor": lambda x, mask, value, *, out: torch.where(
            mask, value.to(device=x.device, dtype=x.dtype), x, out=out
        ),
        "aten.native_dropout_backward.default": lambda g, mask, scale, *, out: torch.mul(g, mask, out=out).mul_(scale),
        "aten.div.Scalar": lambda x, other, *, out: torch.div(x, other, out=out),
        "aten.mul.Scalar": lambda x, other, *, out: torch.mul(x, other, out=out),
        "aten.add.Scalar": lambda x, other, alpha=1, *, out: torch.add(x, other, alpha=alpha, out=out),
        "aten.sub.Scalar": lambda x, other, alpha=1, *, out: torch.sub(x, other, alpha=alpha, out=out),
    }


@functools.cache
def composite_out(target: str) -> bool:
    """True when the `out=` overload of `target` has no kernel of its own, only PyTorch's generated composite
    (CompositeExplicitAutograd, no CPU kernel): it runs the functional op into a fresh tensor and copies that into
    `out`, a temporary outside the arena and a copy per call. The dispatch table is the device-generic one (a CPU
    build registers no CUDA kernels), and those composites are generated for every device alike."""
    found = out_variant(target)
    schema = getattr(found[0], "_schema", None) if found is not None else None
    if schema is None:  # a lambda of ours (empty, a random op's in-place twin): it writes the slot
        return False
    import torch

    name = f"{schema.name}.{schema.overload_name}" if schema.overload_name else schema.name
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    return has(name, "CompositeExplicitAutograd") and not has(name, "CPU")


@functools.cache
def arena_kernel(target: str, composites: bool = False) -> tuple[Any, tuple[str, ...]] | None:
    """What the arena runs for op `target` to write its outputs into their slots, and its out arguments: the `out=`
    overload (out_variant) where it has a kernel of its own, a rewrite of ours (_rewrites) where it is a composite we
    can run on the slot; a composite without one only with `composites` (it copies each output once more and holds a
    temporary of it beside the whole arena), else None: the op runs as without planned addresses."""
    found = out_variant(target)
    if found is None or not composite_out(target):
        return found
    rewrite = _rewrites().get(target)
    return (rewrite, found[1]) if rewrite is not None else (found if composites else None)


def _peak(a: Addresses) -> int:
    """The predicted step peak of planned addresses, summed over the devices: each arena and the most outside it."""
    return sum(a.arena_bytes.values()) + sum(a.outside_peak.values())


def _temporary(op: Op, graph: Graph) -> int:
    """Bytes a placed op run through a composite `out=` allocates beside the arena: its outputs, made by the
    functional op before they are copied into their slots."""
    if not composite_out(op.target) or op.target in _rewrites():
        return 0
    return sum(graph.value[v].nbytes for v in op.outputs)


def aliases(op: Op) -> bool:
    """True when some output of op may share storage with an input (schema `Tensor(a)` returns, getitem, and
    _unsafe_view, which aliases without saying so in its schema)."""
    if op.target in ("getitem", "aten._unsafe_view.default"):
        return True
    from xsched.contracts.torch_ops import resolve

    try:
        schema = resolve(op.target)._schema
    except (XschedError, AttributeError):
        return True
    return any(r.alias_info is not None for r in schema.returns)


def value_dtype(v: Value) -> torch.dtype | None:
    """The torch dtype `v` records (None without one, or for a name torch does not know)."""
    if not v.dtype:
        return None
    import torch

    dt = getattr(torch, v.dtype, None)
    return dt if isinstance(dt, torch.dtype) else None


def writable(v: Value) -> bool:
    """True when a tensor laid out as `v` records (shape, strides) can be written: no two elements share memory."""
    if v.shape is None or value_dtype(v) is None:
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
    return storage_numel(v.shape or (), stride, offset) * value_dtype(v).itemsize  # type: ignore[union-attr]


class ArenaPlan:
    """Which residencies of `plan` run in the arena (the rules in the module's docstring) and their addresses. Needs
    op schemas, not devices: it sizes plans of graphs captured elsewhere (scripts/bench_reserved_model.py, `--explain`).
    `time_limit_s` > 0: the search and CP-SAT improve on the offsets for that long (the executor's have none: greedy
    and the seeded search within its fixed work, xsched.allocator.arena_search). `profile`: op workspaces measured
    there (else the graph's) count outside the arena during their op's step (Addresses.outside_peak)."""

    def __init__(
        self,
        graph: Graph,
        plan: Plan,
        watch: frozenset[str] = frozenset(),
        time_limit_s: float = 0.0,
        handed: bool = True,
        profile: Profile | None = None,
    ):
        self.graph, self.plan = graph, plan
        self.handed = handed  # the caller is handed the forward outputs at the autograd boundary (wrap)
        self.outputs = frozenset(graph.outputs)
        self.ends = {r.key: r.end for r in residencies(graph, plan)}
        self.placeable = _placeable(graph, watch)
        self.time_limit_s, self.profile = time_limit_s, profile
        # composites placed (temporary + copy) or run outside: the smaller predicted peak, outside on a tie (no copies)
        *chosen, left = self._select(composites=False)
        if left:
            *placed, _ = self._select(composites=True)
            if _peak(placed[2]) < _peak(chosen[2]):
                chosen = placed
        self.compute_steps, self.copy_steps, self.addresses = chosen  # the steps that write into the arena
        self.composites = any(i in self.addresses.temporary for i in self.compute_steps)

    def _select(self, composites: bool) -> tuple[set[int], set[int], Addresses, bool]:
        """The compute and copy steps that write into the arena, the addresses of what they place, and whether some
        compute with outputs that fit was left out for its composite `out=` alone; `composites`: ops whose `out=` is
        a composite without a rewrite are placed too (their temporaries counted outside)."""
        graph, plan = self.graph, self.plan
        computes: set[int] = set()
        copies: set[int] = set()
        keys: set[tuple[str, str, int]] = set()  # the residencies placed
        left = False
        for i, s in enumerate(plan.steps):
            if isinstance(s, Compute):
                op = graph.op[s.op]
                fit = [(v, s.device, i) for v in op.outputs if self._fits(v, s.device, i)]
                if fit and _writes_out(graph, op, composites):
                    # outputs not placed (graph outputs, gradients) are written into fresh tensors of their layout
                    computes.add(i)
                    keys.update(fit)
                elif fit and not composites:
                    left = left or _writes_out(graph, op, composites=True)
            elif isinstance(s, Copy) and self._fits(s.value, s.dst, i):
                copies.add(i)
                keys.add((s.value, s.dst, i))
        temporary = {i: n for i in computes if (n := _temporary(graph.op[plan.steps[i].op], graph))}
        scratch = {
            i: (s.device, op_workspace(graph.op[s.op], s.device, self.profile) + temporary.get(i, 0))
            for i, s in enumerate(plan.steps)
            if isinstance(s, Compute)
        }
        addresses = plan_addresses(
            graph,
            plan,
            lambda r: r.key in keys,
            {v: slot_bytes(graph.value[v]) for v in self.placeable},
            time_limit_s=self.time_limit_s,
            to_the_end=not self.handed,
            scratch=scratch,
        )
        return computes, copies, replace(addresses, temporary=temporary), left

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


def _placeable(graph: Graph, watch: frozenset[str]) -> set[str]:
    """Values that may have a slot: not watched, of some bytes, laid out writably, and neither read nor made by an
    aliasing op (op schemas are read only for ops touching such a value)."""
    ok = {v.id for v in graph.values if v.id not in watch and v.nbytes > 0 and writable(v) and slot_bytes(v) > 0}
    aliased = {
        v for o in graph.ops if ok.intersection((*o.inputs, *o.outputs)) and aliases(o) for v in (*o.inputs, *o.outputs)
    }
    return ok - aliased


def _writes_out(graph: Graph, op: Op, composites: bool) -> bool:
    """Whether the executor can run `op` writing into slots (`composites`: a composite `out=` counts): an `out=`
    overload with one out argument per output, its outputs returned plainly (a tuple in order, or the one tensor)
    and every one writable."""
    found = arena_kernel(op.target, composites)
    paths = [tuple(p) for p in (op.call or {}).get("outs", ())]
    regular = paths == ([()] if len(paths) == 1 else [(j,) for j in range(len(paths))])
    if found is None or not regular or len(paths) != len(found[1]) or len(op.outputs) != len(paths):
        return False
    return all(writable(graph.value[v]) for v in op.outputs)
