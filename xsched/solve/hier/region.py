"""A block as a problem of its own: the sub-graph of its ops (inputs: every value it reads from outside it;
outputs: every value it makes that is read outside it or is a graph output), its profile, and its homes."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

from xsched.contracts.graph import Graph, Value
from xsched.contracts.profile import Profile


@dataclass(frozen=True)
class Region:
    """The sub-graph of a block: forward part `f_ops`, backward part `b_ops` (graph order), the values it reads
    from outside (`inputs`) and the values it leaves for others, made by its forward part (`f_outputs`, which must
    be resident when its backward part starts) or left by its backward part (`b_outputs`: those it makes, then
    values kept for a deferred gradient op that its forward part makes)."""

    graph: Graph
    f_ops: tuple[str, ...]
    b_ops: tuple[str, ...]
    inputs: tuple[str, ...]
    f_outputs: tuple[str, ...]
    b_outputs: tuple[str, ...]
    late: tuple[str, ...] = ()  # the b_outputs read by its own ops only (kept for a deferred gradient op)
    grads: frozenset[str] = frozenset()  # the gradients it makes that a deferred gradient op can make again

    @property
    def outputs(self) -> tuple[str, ...]:
        return self.f_outputs + self.b_outputs


def plain(region: Region) -> Region:
    """The region without its late outputs: what its plans are made for (a plan that keeps them is derived)."""
    if not region.late:
        return region
    late = set(region.late)
    b_out = tuple(v for v in region.b_outputs if v not in late)
    graph = replace(region.graph, outputs=tuple(v for v in region.graph.outputs if v not in late))
    return replace(region, graph=graph, b_outputs=b_out, late=())


def deferring_graph(region: Region, ops: Sequence[str]) -> Graph:
    """The region's graph for a plan that defers the gradients of `ops`: they are not outputs (freed once made),
    the late outputs are."""
    sub = region.graph
    grads = {v for o in ops for v in sub.op[o].outputs if v in region.grads}
    return replace(sub, outputs=tuple(v for v in sub.outputs if v not in grads))


DEFER_RATIO = 0.5  # a gradient op is deferrable when its inputs to keep are at most this share of what it defers


def late_grads(graph: Graph, ops: Iterable[str]) -> frozenset[str]:
    """The outputs of `ops` that are unread graph outputs (what deferring them defers)."""
    outs = set(graph.outputs)
    return frozenset(v for o in ops for v in graph.op[o].outputs if v in outs and not graph.consumers[v])


def deferrable(graph: Graph) -> dict[str, tuple[str, ...]]:
    """Backward ops worth running again late to make their unread graph outputs (parameter gradients) then, as the
    flat optimum does (it frees a weight's gradient at once and remakes it after the peak): op -> the values to keep
    for it (its inputs other than graph inputs), when they are at most DEFER_RATIO of the bytes it defers."""
    size = {v.id: v.nbytes for v in graph.values}
    ins = set(graph.inputs)
    found: dict[str, tuple[str, ...]] = {}
    for o in graph.ops:
        late = sum(size[v] for v in late_grads(graph, [o.id]))
        keep = tuple(dict.fromkeys(v for v in o.inputs if v not in ins))
        if o.phase == "bwd" and late and sum(size[v] for v in keep) <= DEFER_RATIO * late:
            found[o.id] = keep
    return found


def make_region(
    graph: Graph,
    f_ops: Sequence[str],
    b_ops: Sequence[str],
    name: str = "",
    kept: frozenset[str] = frozenset(),
    grads: frozenset[str] = frozenset(),
) -> Region:
    """The region of ops `f_ops` + `b_ops` of `graph` (a convex set: its graph order is topological). Values in
    `kept` that it makes are outputs too (the level above keeps them for a deferred gradient op); `grads`: the
    gradients deferred gradient ops make."""
    mine = set(f_ops) | set(b_ops)
    ops = [o for o in graph.ops if o.id in mine]
    made = {v for o in ops for v in o.outputs}
    read = list(dict.fromkeys(v for o in ops for v in o.inputs))
    inputs = [v for v in read if v not in made]
    graph_out = set(graph.outputs)
    needed = {v for v in made if v in graph_out or any(c not in mine for c in graph.consumers[v])}
    late = {v for v in made if v in kept} - needed  # left at the end: never forced resident at the boundary
    fset = set(f_ops)

    def leaves(op_ids: Iterable[str], keep: set[str]) -> tuple[str, ...]:
        return tuple(v for o in op_ids for v in graph.op[o].outputs if v in keep)

    f_ids, b_ids = [o.id for o in ops if o.id in fset], [o.id for o in ops if o.id not in fset]
    f_out, b_out = leaves(f_ids, needed), leaves(b_ids, needed | late) + leaves(f_ids, late)  # late: read by b_ops only
    bwd_made = {v for o in graph.ops if o.phase == "bwd" for v in o.outputs}
    values: list[Value] = []
    present = set(inputs) | made
    for v in graph.values:
        if v.id not in present:
            continue
        if v.id in made:
            values.append(_trim(v, present))
        elif v.id in graph.producer:  # made by another block: an input here, a tangent if a backward op made it
            values.append(Value(v.id, v.nbytes, "tangent" if v.id in bwd_made else "input", v.shape, v.dtype))
        else:
            values.append(_trim(v, present))
    fwd = tuple({"ref": v} for v in f_out) if b_ops else None
    held = tuple(v for v in graph.held_outputs if v in f_out) if b_ops else ()  # the caller's hold, kept below
    sub = Graph(name or graph.name, tuple(values), tuple(ops), f_out + b_out, forward_outputs=fwd, held_outputs=held)
    return Region(
        sub,
        tuple(o.id for o in ops if o.id in fset),
        tuple(o.id for o in ops if o.id not in fset),
        tuple(inputs),
        f_out,
        b_out,
        tuple(v for v in b_out if v in late),
        frozenset(made & grads),
    )


def _trim(v: Value, present: set[str]) -> Value:
    """The value without links (grad_of, updates) to values outside the region."""
    return replace(
        v, grad_of=v.grad_of if v.grad_of in present else None, updates=v.updates if v.updates in present else None
    )


def sub_profile(profile: Profile, sub: Graph) -> Profile:
    """The profile restricted to the region's ops, for its fingerprint; the devices that run no op of the whole
    graph declared its stores (a device that runs none of the region's ops is no store)."""
    ops = set(sub.op)
    compute = {d: {o: c for o, c in costs.items() if o in ops} for d, costs in profile.compute.items()}
    stores = tuple(d for d in profile.devices if profile.is_store(d))
    calibrated = {d: b for d, b in profile.back_to_back.items() if compute.get(d)}  # only devices that run an op
    return replace(profile, graph=sub.fingerprint, compute=compute, stores=stores, back_to_back=calibrated)


def region_homes(region: Region, homes: Mapping[str, str], home: str) -> dict[str, str]:
    """Graph inputs stay on their homes; every other input (made by another block) starts on `home`."""
    return {v: homes.get(v, home) for v in region.inputs}
