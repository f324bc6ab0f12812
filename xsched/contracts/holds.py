"""Outputs the caller holds through backward (`graph.held_outputs`) that a plan may release and make again: the
caller's own storage is emptied in place after the boundary (`untyped_storage().resize_(0)`) and refilled before
the step returns, by a copy back from a store or by the op's `out=` form writing into it. Which held outputs may
be released (`releasable`), which must stay resident (`pinned_holds`), and which steps of a plan release and
refill them (`held_steps`), for the solvers' hold rule and the executor alike."""

from __future__ import annotations

from collections.abc import Iterator, Set
from contextlib import contextmanager
from contextvars import ContextVar
from functools import cache

from xsched.contracts.graph import Graph, Op
from xsched.contracts.plan import Compute, Copy, Free, Plan, Step


@cache
def into_target(target: str) -> str | None:
    """The `out=` overload of aten op `target` ("aten.mm.default" -> "aten.mm.out") where it takes the functional
    form's arguments, in order, and one `out` tensor it returns; else None. Random ops (a rerun replays their
    draws into a fresh tensor), ops run through dtype adapters or stand-ins on some devices, and view ops (which
    have no `out=` form) have none."""
    import torch  # here: planning a graph file whose outputs nobody holds imports no torch

    from xsched.contracts.device_dtypes import DEVICE_TYPED
    from xsched.contracts.device_kernels import DEVICE_KERNELS

    parts = target.split(".")
    if len(parts) != 3 or parts[0] != "aten" or parts[2] == "out" or target in DEVICE_TYPED or target in DEVICE_KERNELS:
        return None
    try:
        packet = getattr(torch.ops.aten, parts[1])
        fn, out = getattr(packet, parts[2]), packet.out
    except (AttributeError, RuntimeError):
        return None
    if torch.Tag.nondeterministic_seeded in fn.tags or len(fn._schema.returns) != 1:
        return None
    outs = [a for a in out._schema.arguments if a.is_out]
    names = [a.name for a in out._schema.arguments if not a.is_out]
    if len(outs) != 1 or names != [a.name for a in fn._schema.arguments]:
        return None
    return f"aten.{parts[1]}.out"


def refills_in_place(op: Op) -> bool:
    """`op` can make its one output again inside a given tensor: an `out=` form, and its output is its whole return."""
    return (
        len(op.outputs) == 1
        and isinstance(op.call, dict)
        and op.call.get("outs") == [[]]
        and into_target(op.target) is not None
    )


_PINNED: ContextVar[bool] = ContextVar("xsched_holds_pinned", default=False)


@contextmanager
def holds_pinned(on: bool = True) -> Iterator[None]:
    """Within it (`on`), no held output is releasable: plans keep every one resident from the boundary to the end,
    as the solvers planned before releases existed (solve.registry tries that first)."""
    token = _PINNED.set(on)
    try:
        yield
    finally:
        _PINNED.reset(token)


def all_pinned() -> bool:
    """Whether this context is within `holds_pinned` (a worker process is told it: solve.hier.blocks)."""
    return _PINNED.get()


def releasable(graph: Graph) -> frozenset[str]:
    """The held outputs a plan may release after the boundary: their producer refills them in place (so the
    storage the caller holds is the producer's own, never a view of another value's); none within `holds_pinned`."""
    if not graph.held_outputs or _PINNED.get():
        return frozenset()
    return frozenset(
        v for v in graph.held_outputs if v in graph.producer and refills_in_place(graph.op[graph.producer[v]])
    )


def pinned_holds(graph: Graph) -> tuple[str, ...]:
    """The held outputs that stay resident from the boundary to the end: those no plan may release."""
    free = releasable(graph)
    return tuple(v for v in graph.held_outputs if v not in free)


def held_steps(graph: Graph, plan: Plan) -> dict[int, tuple[str, str]]:
    """Step index -> ("release" | "refill", value) for the steps of `plan` after its boundary that free a releasable
    held output on a device where it was resident at the boundary (the caller's storage), and that make it there
    again: a copy into, or a compute (through its `out=` form) of, that same storage. Only pairs: a free that
    nothing makes again there (a plan `hold_to_end` did not see) releases nothing, as any free of a held tensor."""
    free, b = releasable(graph), plan.boundary
    if not free or b is None:  # (nothing held: no torch imported)
        return {}
    on: dict[str, set[str]] = {}  # held output -> devices where it is resident (the caller's storage among them)
    for s in plan.steps[:b]:
        follow(graph, s, free, on)
    pinned = {(v, d) for v, ds in on.items() for d in ds}
    out: dict[int, tuple[str, str]] = {}
    released: dict[tuple[str, str], int] = {}  # residency -> the step that released it, until refilled
    for i in range(b, len(plan.steps)):
        s = plan.steps[i]
        if isinstance(s, Free) and (s.value, s.device) in pinned:
            released[(s.value, s.device)] = i
            continue
        made = (s.value, s.dst) if isinstance(s, Copy) else None
        if isinstance(s, Compute):
            made = next(((v, s.device) for v in graph.op[s.op].outputs if (v, s.device) in released), None)
        if made is not None and made in released:
            out[released.pop(made)] = ("release", made[0])
            out[i] = ("refill", made[0])
    return dict(sorted(out.items()))  # a free never refilled stays a plain free: the caller keeps its bytes


def follow(graph: Graph, s: Step, values: Set[str], where: dict[str, set[str]]) -> None:
    """Update `where` (value -> devices where it is resident), for `values`, by plan step `s`."""
    if isinstance(s, Compute):
        for v in values.intersection(graph.op[s.op].outputs):
            where.setdefault(v, set()).add(s.device)
    elif isinstance(s, Copy) and s.value in values:
        where.setdefault(s.value, set()).add(s.dst)
    elif isinstance(s, Free) and s.value in values:
        where.get(s.value, set()).discard(s.device)
