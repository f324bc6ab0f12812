"""Lowering a traced joint FX graph to an xsched Graph: views folded into refs, dead code dropped, phases assigned."""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch._prims_common import is_non_overlapping_and_dense_or_false
from torch.fx import GraphModule, Node

from xsched.contracts.graph import Graph, Op, Value
from xsched.contracts.torch_ops import (
    apply_view,
    dtype_name,
    encode_constant,
    encode_literal,
    iter_refs,
    resolve,
    target_name,
)
from xsched.errors import CaptureError

# Not views by schema, but they reinterpret their input's memory without copying it.
_ALSO_VIEWS = {torch.ops.aten._unsafe_view.default, torch.ops.aten.lift_fresh.default}


@dataclass(frozen=True)
class Slot:
    """A placeholder of the traced function: what kind of graph input it is and its value id."""

    kind: str
    key: str  # param/buffer qualified name, input position or output position
    vid: str

    @property
    def name(self) -> str:
        """Value.name: the qualified name of a param or buffer, else "input:i" / "tangent:i"."""
        return self.key if self.kind in ("param", "buffer") else self.vid


@dataclass(frozen=True)
class TraceInfo:
    """What capture knows about the traced function's inputs and flat outputs."""

    slots: tuple[Slot, ...]
    n_outputs: int  # forward outputs come first among the traced outputs
    grad_of: tuple[str, ...]  # value id of the param/input whose gradient each next output is
    updates: tuple[str, ...]  # value id of each mutated buffer ...
    update_positions: tuple[int, ...]  # ... and the position of its new value among the outputs
    node_module: Callable[[int], tuple[tuple[str, str], ...]]
    inference: bool
    training: bool
    input_requires_grad: dict[int, bool] = field(default_factory=dict)
    unused_grads: tuple[str, ...] = ()
    forward_nodes: int = -1  # traced nodes before backward began (-1: unknown)


def is_view(target: Any) -> bool:
    if target in _ALSO_VIEWS:
        return True
    if not isinstance(target, torch._ops.OpOverload):
        return False
    rets = target._schema.returns
    return bool(rets) and all(r.alias_info is not None and not r.alias_info.is_write for r in rets)


def _is_write(target: torch._ops.OpOverload) -> bool:
    return any(a.alias_info is not None and a.alias_info.is_write for a in target._schema.arguments)


def _is_random(target: Any) -> bool:
    if isinstance(target, Op):
        target = resolve(target.target)
    return torch.Tag.nondeterministic_seeded in getattr(target, "tags", ())


def _nbytes(t: Any) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


def _layout(t: Any) -> dict[str, Any]:
    """A traced tensor's strides and storage offset where they are not a fresh contiguous tensor's: profiling and
    copies rebuild the value that way, so the view chains folded into its readers (a transpose, then a view of
    SDPA's output) work as in eager."""
    if not isinstance(t, torch.Tensor) or t.layout != torch.strided:
        return {}
    offset = int(t.storage_offset())
    if t.is_contiguous() and offset == 0:
        return {}
    return {"stride": tuple(int(s) for s in t.stride()), "storage_offset": offset}


def _positional(node: Node) -> list[Any]:
    """A view node's arguments after its base, positional (kwargs filled in schema order)."""
    args = list(node.args)
    if node.kwargs:
        for a in node.target._schema.arguments[len(args) :]:
            args.append(node.kwargs.get(a.name, a.default_value))
    return args[1:]


class _Lowering:
    def __init__(self, gm: GraphModule, info: TraceInfo) -> None:
        self.gm, self.info = gm, info
        self.nodes = list(gm.graph.nodes)
        self.index = {n: i for i, n in enumerate(self.nodes)}
        self.ref: dict[Node, dict[str, Any]] = {}  # node -> encoded ref (or inline constant)
        self.values: list[Value] = []
        self.ops: list[Op] = []
        self.op_node: dict[str, Node] = {}
        self.returned = list(self.nodes[-1].args[0])

    def run(self) -> None:
        self.live = live = self._live()
        placeholders = [n for n in self.nodes if n.op == "placeholder"]
        if len(placeholders) != len(self.info.slots):
            raise CaptureError(f"traced {len(placeholders)} inputs, expected {len(self.info.slots)}")
        for n, slot in zip(placeholders, self.info.slots):
            val = n.meta["val"]
            self.values.append(
                Value(
                    slot.vid,
                    _nbytes(val),
                    slot.kind,
                    tuple(val.shape),
                    dtype_name(val.dtype),
                    slot.name,
                    **_layout(val),
                )
            )
            self.ref[n] = {"ref": slot.vid}
        for n in self.nodes:
            if n not in live or n.op in ("placeholder", "output"):
                continue
            if n.op == "get_attr":
                self.ref[n] = encode_constant(getattr(self.gm, n.target))
            elif n.op != "call_function":
                raise CaptureError(f"unsupported FX node {n.op} {n.target}")
            elif n.target is operator.getitem:
                src, i = n.args
                if src in self.ref:  # an element of a folded view list (split, unbind)
                    self.ref[n] = self._extend(src, "getitem", [i])
            elif is_view(n.target):
                self.ref[n] = self._fold(n)
            else:
                self._emit(n)

    def _live(self) -> set[Node]:
        """Ancestors of the returned nodes and of random ops (kept so the RNG advances as in eager)."""
        live: set[Node] = set()
        stack = [n for n in self.returned if isinstance(n, Node)]
        stack += [n for n in self.nodes if n.op == "call_function" and _is_random(n.target)]
        while stack:
            n = stack.pop()
            if n not in live:
                live.add(n)
                stack.extend(n.all_input_nodes)
        return live

    def _extend(self, base: Node, target: str, args: list[Any]) -> dict[str, Any]:
        r = self.ref[base]
        if "ref" not in r:  # a view of an inline constant: take it now, inline the result
            return encode_constant(
                apply_view(torch.tensor(r["tensor"], dtype=getattr(torch, r["dtype"])), [[target, args]])
            )
        return {"ref": r["ref"], "view": [*r.get("view", []), [target, args]]}

    def _fold(self, n: Node) -> dict[str, Any]:
        base = n.args[0]
        if not isinstance(base, Node) or base not in self.ref:
            raise CaptureError(f"view {n.target} of an unsupported base {base!r}", op=n.name)
        rest = _positional(n)
        if any(isinstance(x, Node) for x in rest):
            raise CaptureError(f"view {n.target} takes a tensor argument; cannot fold it", op=n.name)
        return self._extend(base, target_name(n.target), encode_literal(rest))

    def _encode(self, x: Any) -> Any:
        if isinstance(x, Node):
            if x not in self.ref:
                raise CaptureError(f"argument {x.name} is a list-valued op output used whole; not supported", op=x.name)
            return self.ref[x]
        if isinstance(x, (list, tuple)):
            return [self._encode(y) for y in x]
        return encode_literal(x)

    def _leaves(self, n: Node, path: tuple[int, ...] = ()) -> list[tuple[tuple[int, ...], Node]]:
        """Output leaves of an op node: getitem chains down to a node something else reads."""
        out: list[tuple[tuple[int, ...], Node]] = []
        users = [u for u in n.users if u in self.live]
        direct = any(u.target is not operator.getitem for u in users) or n in self.returned
        if direct or not users:
            out.append((path, n))
        for u in users:
            if u.target is operator.getitem:
                out.extend(self._leaves(u, (*path, u.args[1])))
        return sorted(out, key=lambda x: x[0])

    def _emit(self, n: Node) -> None:
        target = n.target
        if not isinstance(target, torch._ops.OpOverload):
            raise CaptureError(
                f"unsupported call {getattr(target, '__name__', target)!r} (not an aten operator)", op=n.name
            )
        if _is_write(target):
            raise CaptureError(f"in-place op {target} survived functionalization", op=n.name)
        op_id = f"op{len(self.ops)}"
        args, kwargs = self._encode(list(n.args)), {k: self._encode(v) for k, v in n.kwargs.items()}
        inputs = tuple(dict.fromkeys(r["ref"] for r in iter_refs([args, kwargs])))
        val = n.meta.get("val")
        outputs, outs, used = [], [], set()
        for path, leaf in self._leaves(n):
            t = val
            for i in path:
                t = t[i]
            if leaf is n and not any(u in self.live for u in n.users) and n not in self.returned:
                continue  # a dead random op: run for its RNG effect, result unused
            if not isinstance(t, torch.Tensor):
                raise CaptureError(f"{target} output {list(path)} is not a tensor but is used whole", op=n.name)
            if t.layout != torch.strided:  # its bytes, copies and frees are not a dense tensor's
                raise CaptureError(
                    f"{target} makes a {str(t.layout).removeprefix('torch.')} tensor; xsched runs dense tensors "
                    "only (sparse gradients: nn.Embedding(..., sparse=False))",
                    op=n.name,
                )
            vid = f"v{len(self.values)}"
            self.values.append(Value(vid, _nbytes(t), "activation", tuple(t.shape), dtype_name(t.dtype), **_layout(t)))
            self.ref[leaf] = {"ref": vid}
            outputs.append(vid)
            outs.append(list(path))
            used.add(path)
        workspace = sum(_nbytes(t) for p, t in _tensor_paths(val) if p not in used)
        stack = self.info.node_module(self.index[n])
        self.ops.append(
            Op(
                op_id,
                target_name(target),
                inputs,
                tuple(outputs),
                "fwd",
                stack[-1][0] if stack else "",
                workspace,
                {"args": args, "kwargs": kwargs, "outs": outs},
                {"node": n.name},
            )
        )
        self.op_node[op_id] = n


def _tensor_paths(val: Any, path: tuple[int, ...] = ()) -> list[tuple[tuple[int, ...], torch.Tensor]]:
    if isinstance(val, torch.Tensor):
        return [(path, val)]
    if isinstance(val, (list, tuple)):
        return [x for i, v in enumerate(val) for x in _tensor_paths(v, (*path, i))]
    return []


def _is_loss(stack: tuple[tuple[str, str], ...]) -> bool:
    """Inside a module whose class ends in "Loss", or a functional loss (marked "F.<name>:Loss" by capture)."""
    return any(cls.endswith("Loss") for _, cls in stack)


def build_graph(gm: GraphModule, info: TraceInfo, name: str) -> Graph:
    """The xsched Graph of a traced joint function (see xsched.capture.torch.capture)."""
    low = _Lowering(gm, info)
    low.run()
    returned = low.returned
    nvals = {v.id: v for v in low.values}
    fwd_refs = [low.ref[n] if isinstance(n, Node) else encode_literal(n) for n in returned[: info.n_outputs]]
    grad_pos = {g: info.n_outputs + k for k, g in enumerate(info.grad_of)}
    upd_pos = dict(zip(info.updates, info.update_positions))
    grad_refs = {g: low.ref[returned[p]] for g, p in grad_pos.items()}
    upd_refs = {b: low.ref[returned[p]] for b, p in upd_pos.items()}
    # A gradient or buffer update must be its own value (grad_of/updates name it); copy when it is not.
    claimed = {r["ref"] for r in fwd_refs if "ref" in r}
    producer = {v for o in low.ops for v in o.outputs}
    extra_ops: dict[str, list[Op]] = {"fwd": [], "bwd": []}
    role: dict[str, Value] = {}
    for kind, refs, pos in (("updates", upd_refs, upd_pos), ("grad_of", grad_refs, grad_pos)):
        for target, r in refs.items():
            if "ref" not in r:
                raise CaptureError(f"{kind} of {target} is a constant; not supported", value=target)
            if r["ref"] in claimed or r["ref"] not in producer:
                t = returned[pos[target]].meta["val"]
                kept = (
                    {"stride": _layout(t).get("stride")} if is_non_overlapping_and_dense_or_false(t) else {}
                )  # as clone does
                new = Value(
                    f"v{len(low.values)}", _nbytes(t), "activation", tuple(t.shape), dtype_name(t.dtype), **kept
                )
                low.values.append(new)
                nvals[new.id] = new
                n_ops = len(low.ops) + sum(map(len, extra_ops.values()))
                call = {"args": [r], "kwargs": {}, "outs": [[]]}
                clone = Op(
                    f"op{n_ops}", "aten.clone.default", (r["ref"],), (new.id,), "fwd", "", 0, call, {"node": "clone"}
                )
                extra_ops["fwd" if kind == "updates" else "bwd"].append(clone)
                refs[target] = r = {"ref": new.id}
            claimed.add(r["ref"])
            role[r["ref"]] = Value(**{**nvals[r["ref"]].__dict__, kind: target})
    values = tuple(role.get(v.id, v) for v in low.values)
    ops = [*low.ops, *extra_ops["fwd"], *extra_ops["bwd"]]
    ops = _phase(ops, info, [r["ref"] for r in fwd_refs if "ref" in r] + [r["ref"] for r in upd_refs.values()], low)
    outputs = [r["ref"] for r in fwd_refs if "ref" in r] + [r["ref"] for r in grad_refs.values()]
    outputs += [r["ref"] for r in upd_refs.values()]
    extra = {
        "capture": "torch",
        "inference": info.inference,
        "training": info.training,
        "inputs_requiring_grad": [f"input:{i}" for i, rg in sorted(info.input_requires_grad.items()) if rg],
        "unused_grads": list(info.unused_grads),
    }
    return Graph(
        name,
        values,
        tuple(ops),
        tuple(dict.fromkeys(outputs)),
        extra,
        forward_outputs=tuple(fwd_refs),
        grads={g.removeprefix("param:"): r for g, r in grad_refs.items() if g.startswith("param:")},
        input_grads={int(g.removeprefix("input:")): r for g, r in grad_refs.items() if g.startswith("input:")},
        buffer_updates={b.removeprefix("buffer:"): r for b, r in upd_refs.items()},
    )


def _phase(ops: list[Op], info: TraceInfo, fwd_roots: list[str], low: _Lowering) -> tuple[Op, ...]:
    """fwd (or loss) = ancestors of the forward outputs and buffer updates, listed first; the rest is bwd."""
    if info.inference:
        return tuple(ops)
    producer = {v: o for o in ops for v in o.outputs}
    fwd: set[str] = set()
    stack = [producer[v] for v in fwd_roots if v in producer]
    # random ops traced in forward stay there even when no forward output needs them: eager's RNG order
    stack += [o for o in ops if low.index.get(low.op_node.get(o.id), -1) in range(info.forward_nodes) and _is_random(o)]
    while stack:
        o = stack.pop()
        if o.id not in fwd:
            fwd.add(o.id)
            stack.extend(producer[v] for v in o.inputs if v in producer)
    out = []
    for o in ops:
        if o.id in fwd:
            node = low.op_node.get(o.id)
            loss = node is not None and _is_loss(info.node_module(low.index[node]))
            out.append(Op(**{**o.__dict__, "phase": "loss" if loss else "fwd"}))
    out += [Op(**{**o.__dict__, "phase": "bwd"}) for o in ops if o.id not in fwd]
    return tuple(out)
