"""ONNX capture: an `.onnx` file -> the inference `Graph` of its nodes, sized by ONNX shape inference once every
symbolic dimension is bound (from example inputs or given shapes); initializers become params."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from xsched.capture.onnx_shapes import MAX_DATA_BYTES, dims_of, infer, named_node, one_line
from xsched.contracts.graph import Graph, Op, Value
from xsched.contracts.onnx_ops import FORMAT, encode_array, encode_call, itemsize, require
from xsched.errors import CaptureError

log = logging.getLogger("xsched.capture")

KNOWN_DOMAINS = ("", "ai.onnx.ml", "com.microsoft")  # ONNX's own opsets and ONNX Runtime's contrib ops
Shapes = Mapping[str, Sequence[int]]


@dataclass(frozen=True)
class OnnxCapture:
    """A captured ONNX model: its graph, and the model as loaded (its initializers are the params' content)."""

    graph: Graph
    model: Any  # onnx.ModelProto, local functions inlined


def capture_onnx(
    source: str | Path | Any, shapes: Shapes | None = None, inputs: Any = None, *, name: str | None = None
) -> Graph:
    """The inference graph of an ONNX model (a path or a ModelProto). `shapes` (input name -> dims) or
    `inputs` (arrays by input name, or in input order) bind the symbolic dimensions of its inputs."""
    return capture_model(source, shapes, inputs, name=name).graph


def capture_model(
    source: str | Path | Any, shapes: Shapes | None = None, inputs: Any = None, *, name: str | None = None
) -> OnnxCapture:
    onnx = require("onnx", "capture")
    model, label = load_model(source)
    if model.functions:  # exporters may wrap blocks in local functions: their nodes are what runs
        model = onnx.inliner.inline_local_functions(model)
    check_nodes(model)
    _check(model)
    bound = bind_shapes(model, shapes, inputs)
    types, known = infer(model, bound)
    graph = _graph(model, types, known, name or label)
    return OnnxCapture(graph, model)


def parse_shape(text: str) -> tuple[int, ...]:
    """'1x3x224x224' -> (1, 3, 224, 224); '' or 'scalar' -> ()."""
    text = text.strip().lower()
    if text in ("", "scalar"):
        return ()
    parts = text.split("x")
    if not all(p.strip().isdigit() for p in parts):
        raise CaptureError(f"a shape is dimensions joined by 'x', e.g. 1x3x224x224; got {text!r}")
    return tuple(int(p) for p in parts)


# ---- loading and checking ----
def load_model(source: str | Path | Any) -> tuple[Any, str]:
    """(ModelProto, a label for the graph's name) from a path, bytes or a ModelProto."""
    onnx = require("onnx", "capture")
    if isinstance(source, onnx.ModelProto):
        model = onnx.ModelProto()
        model.CopyFrom(source)
        return model, source.graph.name or "onnx"
    if isinstance(source, bytes):
        return _parse(lambda: onnx.load_from_string(source), "the given bytes"), "onnx"
    path = Path(source)
    if not path.is_file():
        raise CaptureError(f"no ONNX file at {path}")
    return _parse(lambda: onnx.load(str(path)), str(path)), path.stem


def _parse(load: Any, where: str) -> Any:
    try:
        model = load()
    except Exception as e:  # protobuf's DecodeError, a missing external-data file, ...
        raise CaptureError(f"cannot read {where} as an ONNX model (corrupt or truncated?): {one_line(e)}") from e
    if not model.graph.node:
        raise CaptureError(f"{where} holds no ONNX graph nodes (not an ONNX model, or truncated)")
    return model


def node_label(node: Any, index: int) -> str:
    return node.name or f"{node.op_type}_{index}"


def opsets_of(model: Any) -> dict[str, int]:
    return {("" if o.domain == "ai.onnx" else o.domain): int(o.version) for o in model.opset_import}


def check_nodes(model: Any) -> None:
    """Each node is straight-line code (no subgraph) of an opset ONNX or ONNX Runtime knows."""
    onnx = require("onnx", "capture")
    subgraph = (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)
    opsets = opsets_of(model)
    newest = onnx.defs.onnx_opset_version()
    for i, node in enumerate(model.graph.node):
        where, domain = node_label(node, i), ("" if node.domain == "ai.onnx" else node.domain)
        held = [a.name for a in node.attribute if a.type in subgraph]
        if held:
            raise CaptureError(
                f"node {where} ({node.op_type}) holds a subgraph ({', '.join(held)}): control flow "
                "(If, Loop, Scan) is not supported, xsched places straight-line graphs",
                op=where,
            )
        if domain not in opsets:
            raise CaptureError(
                f"node {where} ({node.op_type}) is in domain {domain!r}, which the model does not import", op=where
            )
        version = opsets[domain]
        if domain not in KNOWN_DOMAINS:
            raise CaptureError(
                f"node {where} ({node.op_type}) is in opset domain {domain!r} (version {version}), "
                "unknown to ONNX and ONNX Runtime",
                op=where,
            )
        if domain == "" and version > newest:
            raise CaptureError(
                f"node {where} ({node.op_type}) is in opset {version} of ai.onnx; onnx "
                f"{onnx.__version__} knows opsets up to {newest}",
                op=where,
            )
        if domain != "com.microsoft" and not onnx.defs.has(node.op_type, version, domain):
            raise CaptureError(
                f"node {where}: opset {version} of {domain or 'ai.onnx'} has no operator {node.op_type!r}", op=where
            )


def _check(model: Any) -> None:
    onnx = require("onnx", "capture")
    try:
        onnx.checker.check_model(model)
    except onnx.checker.ValidationError as e:
        raise CaptureError(f"invalid ONNX model: {one_line(e)}", op=named_node(str(e))) from e
    except ValueError as e:  # a model over protobuf's 2 GiB limit cannot be checked in memory: ORT will say
        log.debug("onnx checker skipped: %s", e)


# ---- shapes ----
def bind_shapes(model: Any, shapes: Shapes | None = None, inputs: Any = None) -> dict[str, tuple[int, ...]]:
    """Input name -> concrete dims: the given shape, else the example input's, else the model's own when it
    has no symbolic dimension. A symbolic dimension left unbound is an error naming the input."""
    graph = model.graph
    params = {t.name for t in graph.initializer}
    declared = [i for i in graph.input if i.name not in params]
    names = [i.name for i in declared]
    given = {str(k): tuple(int(d) for d in v) for k, v in (shapes or {}).items()}
    for k, shape in _example_shapes(inputs, names).items():
        if given.setdefault(k, shape) != shape:
            raise CaptureError(
                f"input {k}: shape {_fmt(given[k])} given, but the example input is {_fmt(shape)}", value=k
            )
    unknown = sorted(set(given) - set(names))
    if unknown:
        raise CaptureError(
            f"shape given for {', '.join(unknown)}, not an input of the model (inputs: {', '.join(names)})",
            value=unknown[0],
        )
    bound: dict[str, tuple[int, ...]] = {}
    symbols: dict[str, tuple[int, str]] = {}
    for inp in declared:
        if not inp.type.HasField("tensor_type"):
            raise CaptureError("model input is not a tensor (sequence, map or optional)", value=inp.name)
        dims = dims_of(inp.type.tensor_type)
        want = given.get(inp.name)
        if want is None:
            if dims is None or not all(isinstance(d, int) for d in dims):
                syms = [str(d) for d in dims or () if not isinstance(d, int)] or ["its rank"]
                raise CaptureError(
                    f"input {inp.name} has symbolic dimension(s) {', '.join(syms)} (shape "
                    f"{_fmt(dims)}): bind them with shapes={{{inp.name!r}: (...)}} or --shape "
                    f"{inp.name}=2x3x...",
                    value=inp.name,
                )
            want = tuple(int(d) for d in dims)
        elif dims is not None and (
            len(dims) != len(want) or any(isinstance(d, int) and d != w for d, w in zip(dims, want))
        ):
            raise CaptureError(
                f"shape {_fmt(want)} given for input {inp.name} does not match the model's {_fmt(dims)}", value=inp.name
            )
        for d, w in zip(dims or (), want):
            if isinstance(d, str) and d:
                first = symbols.setdefault(d, (w, inp.name))
                if first[0] != w:
                    raise CaptureError(
                        f"symbolic dimension {d} is {first[0]} in input {first[1]} but {w} in input {inp.name}",
                        value=inp.name,
                    )
        bound[inp.name] = want
    return bound


def _example_shapes(inputs: Any, names: Sequence[str]) -> dict[str, tuple[int, ...]]:
    if inputs is None:
        return {}
    if isinstance(inputs, Mapping):
        return {str(k): tuple(int(d) for d in v.shape) for k, v in inputs.items()}
    items = list(inputs) if isinstance(inputs, (list, tuple)) else [inputs]
    if len(items) > len(names):
        raise CaptureError(f"{len(items)} example inputs for a model with {len(names)} inputs ({', '.join(names)})")
    return {n: tuple(int(d) for d in x.shape) for n, x in zip(names, items)}


def _fmt(dims: Sequence[Any] | None) -> str:
    def one(d: Any) -> str:  # unk__N: a symbol shape inference made up for a dimension it could not work out
        return "?" if d is None or (isinstance(d, str) and d.startswith("unk__")) else str(d)

    return "unknown" if dims is None else "[" + ",".join(one(d) for d in dims) + "]"


# ---- the graph ----
def _graph(model: Any, types: Mapping[str, Any], known: Mapping[str, Any], name: str) -> Graph:
    g = model.graph
    params = {t.name: t for t in g.initializer}
    used = {v for node in g.node for v in node.input if v} | {o.name for o in g.output}
    values: dict[str, Value] = {}
    order = [i.name for i in g.input if i.name not in params]
    for k, vid in enumerate(order):
        values[vid] = _value(vid, types, "input", f"input:{k}", "model input")
    for vid in params:
        if vid in used and vid not in values:
            values[vid] = _value(vid, types, "param", vid, "initializer")
    ops, ids = [], set()
    opsets = opsets_of(model)
    for i, node in enumerate(g.node):
        oid = node.name if node.name and node.name not in ids else f"{node.op_type}_{i}"
        while oid in ids:
            oid += "_"
        ids.add(oid)
        for vid in node.output:
            if vid:
                values[vid] = _value(vid, types, "activation", None, f"output of node {oid} ({node.op_type})", oid)
        ops.append(
            Op(
                id=oid,
                target=_target(node),
                inputs=tuple(dict.fromkeys(v for v in node.input if v)),
                outputs=tuple(v for v in node.output if v),
                phase="fwd",
                name=node.name or oid,
                call=encode_call(node, opsets),
            )
        )
    onnx = require("onnx", "capture")
    known = {**known, **{v: onnx.numpy_helper.to_array(t) for v, t in params.items() if v in values}}
    for vid, arr in known.items():  # profiling runs ops alone: their shape and index inputs need real content
        if vid in values and values[vid].nbytes <= MAX_DATA_BYTES:
            values[vid] = Value(**{**values[vid].__dict__, "extra": {"data": encode_array(arr)}})
    extra = {"onnx": {"ir_version": int(model.ir_version), "opsets": opsets, "inputs": order}}
    return Graph(name, tuple(values.values()), tuple(ops), tuple(o.name for o in g.output), extra)


def _target(node: Any) -> str:
    domain = "" if node.domain == "ai.onnx" else node.domain
    return f"{domain or FORMAT}::{node.op_type}"


def _value(vid: str, types: Mapping[str, Any], kind: str, name: str | None, what: str, op: str | None = None) -> Value:
    tp = types.get(vid)
    if tp is None or not tp.HasField("tensor_type"):
        why = "no type was inferred" if tp is None else "it is not a tensor (sequence, map or optional)"
        raise CaptureError(f"cannot size {vid}, {what}: {why}", op=op, value=vid)
    tt = tp.tensor_type
    dims = dims_of(tt)
    if dims is None or not all(isinstance(d, int) for d in dims):
        how = "its shape depends on the data" if op else "bind its dimensions"
        raise CaptureError(f"cannot infer the shape of {vid}, {what}: got {_fmt(dims)} ({how})", op=op, value=vid)
    dtype, size = itemsize(tt.elem_type, f"{vid} ({what})")
    numel = 1
    for d in dims:
        numel *= int(d)
    return Value(id=vid, nbytes=numel * size, kind=kind, shape=tuple(int(d) for d in dims), dtype=dtype, name=name)
