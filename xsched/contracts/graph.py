"""The graph IR (contract 1, docs/ARCHITECTURE.md): frozen `Graph`, `Op`, `Value`, their validation, fingerprint
and JSON."""

from __future__ import annotations

import gzip
import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from xsched.contracts.layout import LAYOUT_KEYS, check_layout, layout_from_dict, layout_to_dict
from xsched.contracts.toposort import find_cycle
from xsched.errors import GraphError

SCHEMA = "xsched.graph/1"
INPUT_KINDS = frozenset({"input", "param", "buffer", "tangent"})
PHASES = frozenset({"fwd", "bwd", "loss"})


@dataclass(frozen=True)
class Value:
    """A tensor: produced by one op, or a graph input when no op produces it."""

    id: str
    nbytes: int
    kind: str = "activation"
    shape: tuple[int, ...] | None = None
    dtype: str | None = None
    name: str | None = None  # qualified name of a param/buffer, or "input:0", "tangent:0"
    grad_of: str | None = None  # this value is the gradient of that graph input (a param)
    updates: str | None = None  # this value is the new content of that buffer
    extra: Mapping[str, Any] = field(default_factory=dict)
    # ---- layout: how the tensor lies in its storage when eager PyTorch makes it (see `layout`) ----
    stride: tuple[int, ...] | None = None  # None: contiguous
    storage_offset: int = 0


@dataclass(frozen=True)
class Op:
    """One operator. `call` (optional) says how to run it: see xsched/contracts/torch_ops.py."""

    id: str
    target: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    phase: str = "fwd"
    name: str = ""
    workspace_bytes: int = 0
    call: Mapping[str, Any] | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Graph:
    """Values and ops in a valid topological order, and the values that must exist at the end."""

    name: str
    values: tuple[Value, ...]
    ops: tuple[Op, ...]
    outputs: tuple[str, ...]
    extra: Mapping[str, Any] = field(default_factory=dict)
    # ---- training roles of a captured model (None: the graph does not say; a ref is {"ref": value id} with an
    # optional "view", as in an op's `call`): what `wrap` and `unpack_outputs` hand back to the model
    forward_outputs: tuple[Any, ...] | None = None  # per model output: its ref, or a literal (a constant output)
    grads: Mapping[str, Mapping[str, Any]] | None = None  # param name -> ref of its gradient
    input_grads: Mapping[int, Mapping[str, Any]] | None = None  # model input position -> ref of its gradient
    buffer_updates: Mapping[str, Mapping[str, Any]] | None = None  # buffer name -> ref of its new content
    # forward outputs the caller holds from the autograd boundary until the plan ends (`wrap` returns them to code
    # that keeps them through its backward): a plan's free of one there releases nothing. Not in the fingerprint:
    # the same ops and costs, so profiles measured for the graph still match
    held_outputs: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        _validate(self)

    # ---- lookups (derived once, the dataclass itself stays frozen) ----
    @cached_property
    def value(self) -> dict[str, Value]:
        return {v.id: v for v in self.values}

    @cached_property
    def op(self) -> dict[str, Op]:
        return {o.id: o for o in self.ops}

    @cached_property
    def op_index(self) -> dict[str, int]:
        return {o.id: i for i, o in enumerate(self.ops)}

    @cached_property
    def producer(self) -> dict[str, str]:
        """value id -> id of the op that produces it (graph inputs are absent)."""
        return {v: o.id for o in self.ops for v in o.outputs}

    @cached_property
    def consumers(self) -> dict[str, tuple[str, ...]]:
        """value id -> ids of the ops that read it, in graph order."""
        users: dict[str, list[str]] = {v.id: [] for v in self.values}
        for o in self.ops:
            for v in dict.fromkeys(o.inputs):
                users[v].append(o.id)
        return {k: tuple(u) for k, u in users.items()}

    @cached_property
    def inputs(self) -> tuple[str, ...]:
        """Graph inputs: values no op produces."""
        return tuple(v.id for v in self.values if v.id not in self.producer)

    @cached_property
    def fingerprint(self) -> str:
        """sha256 of the canonical JSON, without the graph's display name; the training roles hashed under "extra",
        where files before they were fields kept them, so that profiles measured then still match."""
        body = self.to_dict()
        body.pop("name")
        body.pop("held_outputs", None)
        roles = {k: body.pop(k) for k in ROLES if k in body}
        if roles:
            body["extra"] = {**body.get("extra", {}), **roles}
        text = json.dumps(body, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()[:32]

    def op_bytes(self, op_id: str) -> int:
        """Bytes of an op's inputs + outputs + workspace: what it needs resident to run."""
        o = self.op[op_id]
        return sum(self.value[v].nbytes for v in set(o.inputs) | set(o.outputs)) + o.workspace_bytes

    # ---- JSON ----
    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "name": self.name,
            "values": [_value_to_dict(v) for v in self.values],
            "ops": [_op_to_dict(o) for o in self.ops],
            "outputs": list(self.outputs),
            **_roles_to_dict(self),
            **({"held_outputs": list(self.held_outputs)} if self.held_outputs else {}),
            **({"extra": dict(self.extra)} if self.extra else {}),
        }

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> Graph:
        if not isinstance(d, Mapping) or d.get("schema") != SCHEMA:
            got = d.get("schema") if isinstance(d, Mapping) else type(d).__name__
            raise GraphError(f"unknown graph schema {got!r}, expected {SCHEMA!r}")
        try:
            values = tuple(_value_from_dict(v) for v in d["values"])
            ops = tuple(_op_from_dict(o) for o in d["ops"])
            extra = dict(d.get("extra", {}))
            roles = _roles_from_dict(d, extra)
            held = tuple(d.get("held_outputs", ()))
            return Graph(str(d.get("name", "")), values, ops, tuple(d["outputs"]), extra, **roles, held_outputs=held)
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise GraphError(f"malformed graph JSON: {type(e).__name__}: {e}") from e

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")

    @staticmethod
    def load(path: str | Path) -> Graph:
        try:
            d = json.loads(read_text(path))
        except (OSError, json.JSONDecodeError, UnicodeDecodeError, EOFError) as e:
            raise GraphError(f"cannot read graph file {path}: {e}") from e
        return Graph.from_dict(d)


def read_text(path: str | Path) -> str:
    """A contract file's text; gzipped where its name ends in .gz (benchmarks/gpu/ ships them so)."""
    p = Path(path)
    return gzip.decompress(p.read_bytes()).decode() if p.suffix == ".gz" else p.read_text()


# ---- training roles: top-level keys of the JSON; a file written before they were fields has them in "extra"
ROLES = ("forward_outputs", "grads", "input_grads", "buffer_updates")


def _roles_to_dict(g: Graph) -> dict[str, Any]:
    d: dict[str, Any] = {}
    if g.forward_outputs is not None:
        d["forward_outputs"] = list(g.forward_outputs)
    for k in ("grads", "input_grads", "buffer_updates"):
        refs = getattr(g, k)
        if refs is not None:
            d[k] = {str(key): ref for key, ref in refs.items()}
    return d


def _roles_from_dict(d: Mapping[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """The roles of a graph JSON, from its top level or (an older file) popped from its `extra`."""
    roles: dict[str, Any] = {}
    for k in ROLES:
        old = extra.pop(k, None)
        x = d.get(k, old)
        if x is None:
            continue
        if k == "forward_outputs":
            roles[k] = tuple(x)
        elif k == "input_grads":
            roles[k] = {int(pos): ref for pos, ref in x.items()}
        else:
            roles[k] = dict(x)
    return roles


def _value_to_dict(v: Value) -> dict[str, Any]:
    d: dict[str, Any] = {"id": v.id, "nbytes": v.nbytes, "kind": v.kind}
    for k in ("shape", "dtype", "name", "grad_of", "updates"):
        x = getattr(v, k)
        if x is not None:
            d[k] = list(x) if k == "shape" else x
    d.update(v.extra)
    d.update(layout_to_dict(v))
    return d


def _value_from_dict(d: Mapping[str, Any]) -> Value:
    known = {"id", "nbytes", "kind", "shape", "dtype", "name", "grad_of", "updates", *LAYOUT_KEYS}
    shape = d.get("shape")
    return Value(
        id=str(d["id"]),
        nbytes=int(d["nbytes"]),
        kind=str(d.get("kind", "activation")),
        shape=tuple(int(s) for s in shape) if shape is not None else None,
        dtype=d.get("dtype"),
        name=d.get("name"),
        grad_of=d.get("grad_of"),
        updates=d.get("updates"),
        extra={k: x for k, x in d.items() if k not in known},
        **layout_from_dict(d),
    )


def _op_to_dict(o: Op) -> dict[str, Any]:
    d: dict[str, Any] = {
        "id": o.id,
        "name": o.name,
        "target": o.target,
        "phase": o.phase,
        "inputs": list(o.inputs),
        "outputs": list(o.outputs),
        "workspace_bytes": o.workspace_bytes,
    }
    if o.call is not None:
        d["call"] = o.call
    d.update(o.extra)
    return d


def _op_from_dict(d: Mapping[str, Any]) -> Op:
    known = {"id", "name", "target", "phase", "inputs", "outputs", "workspace_bytes", "call"}
    return Op(
        id=str(d["id"]),
        name=str(d.get("name", "")),
        target=str(d["target"]),
        phase=str(d.get("phase", "fwd")),
        inputs=tuple(str(v) for v in d["inputs"]),
        outputs=tuple(str(v) for v in d["outputs"]),
        workspace_bytes=int(d.get("workspace_bytes", 0)),
        call=d.get("call"),
        extra={k: x for k, x in d.items() if k not in known},
    )


# ---- validation ----
def _validate(g: Graph) -> None:
    values = _unique_ids(g.values, "value")
    _unique_ids(g.ops, "op")
    for v in g.values:
        if not isinstance(v.nbytes, int) or v.nbytes < 0:
            raise GraphError(f"nbytes must be a non-negative integer, got {v.nbytes!r}", value=v.id)
    produced_by: dict[str, str] = {}
    for o in g.ops:
        if o.phase not in PHASES:
            raise GraphError(f"phase must be one of {sorted(PHASES)}, got {o.phase!r}", op=o.id)
        for v in (*o.inputs, *o.outputs):
            if v not in values:
                raise GraphError(f"op refers to unknown value {v!r}", op=o.id, value=v)
        for v in o.outputs:
            if v in produced_by:
                raise GraphError(f"value produced by both {produced_by[v]} and {o.id}", op=o.id, value=v)
            produced_by[v] = o.id
    for v in g.values:
        has_producer = v.id in produced_by
        if not has_producer and v.kind not in INPUT_KINDS:
            raise GraphError(
                f"value has no producer but kind {v.kind!r}; graph inputs are {sorted(INPUT_KINDS)}", value=v.id
            )
        if has_producer and v.kind in INPUT_KINDS:
            raise GraphError(f"value of kind {v.kind!r} is produced by op {produced_by[v.id]}", value=v.id)
    for ref in ("grad_of", "updates"):
        for v in g.values:
            target = getattr(v, ref)
            if target is not None and target not in values:
                raise GraphError(f"{ref} names unknown value {target!r}", value=v.id)
    for v in g.outputs:
        if v not in values:
            raise GraphError("graph output is an unknown value", value=v)
    for v in g.held_outputs:
        if v not in produced_by:
            raise GraphError("held output is not a value an op produces", value=v)
    for v in g.values:
        check_layout(v)
    _check_roles(g, values)
    _check_order(g, produced_by)


def _check_roles(g: Graph, values: set[str]) -> None:
    """Every ref of a training role names a value of the graph; keys are names (input_grads: positions)."""
    refs: list[tuple[str, Any]] = []
    if g.forward_outputs is not None:
        if not isinstance(g.forward_outputs, tuple):
            raise GraphError(f"forward_outputs must be a tuple, got {type(g.forward_outputs).__name__}")
        # a constant output is a literal; only a mapping with "ref" names a value
        refs += [(f"forward_outputs[{i}]", r) for i, r in enumerate(g.forward_outputs) if _is_ref(r)]
    for k in ("grads", "input_grads", "buffer_updates"):
        m = getattr(g, k)
        if m is None:
            continue
        if not isinstance(m, Mapping):
            raise GraphError(f"{k} must be a mapping, got {type(m).__name__}")
        for key, r in m.items():
            if k == "input_grads" and (not isinstance(key, int) or isinstance(key, bool) or key < 0):
                raise GraphError(f"input_grads key must be an input position (int >= 0), got {key!r}")
            if k != "input_grads" and not isinstance(key, str):
                raise GraphError(f"{k} key must be a name, got {key!r}")
            if not _is_ref(r):
                raise GraphError(f"{k}[{key!r}] must be a ref {{'ref': value id}}, got {r!r}")
            refs.append((f"{k}[{key!r}]", r))
    for where, r in refs:
        if r["ref"] not in values:
            raise GraphError(f"{where} names unknown value {r['ref']!r}", value=str(r["ref"]))


def _is_ref(r: Any) -> bool:
    return isinstance(r, Mapping) and "ref" in r


def _unique_ids(items: Iterable[Value] | Iterable[Op], what: str) -> set[str]:
    seen: set[str] = set()
    for it in items:
        if it.id in seen:
            raise GraphError(f"duplicate {what} id", **{what: it.id})
        seen.add(it.id)
    return seen


def _check_order(g: Graph, produced_by: Mapping[str, str]) -> None:
    position = {o.id: i for i, o in enumerate(g.ops)}
    for i, o in enumerate(g.ops):
        for v in o.inputs:
            p = produced_by.get(v)
            if p is not None and position[p] >= i:
                cycle = find_cycle(g.ops, produced_by)
                if cycle:
                    raise GraphError(f"graph has a cycle: {' -> '.join(cycle)}", op=cycle[0])
                raise GraphError(f"ops out of topological order: reads {v!r}, produced later by {p}", op=o.id, value=v)
