"""Shape inference for ONNX capture: ONNX's, run on a copy with the inputs bound and the weights left out, with
the shape arithmetic it cannot follow (Shape -> Gather -> Slice, as older exporters write it) evaluated on ONNX
Runtime and folded into constants until nothing more folds."""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping, Sequence
from typing import Any

from xsched.contracts.onnx_ops import ELEM_TYPES, RANDOM_OPS, require
from xsched.errors import CaptureError

log = logging.getLogger("xsched.capture")

MAX_FOLD_ROUNDS = 16
MAX_DATA_BYTES = 1024  # values known without the inputs and this small carry their content (profiling needs it)


def one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:300]}" if text else type(e).__name__


def named_node(message: str) -> str | None:
    m = re.search(r"node name: ([^)\s]+)\)", message) or re.search(r"Node \(([^)]+)\)", message)
    return m.group(1) if m else None


def dims_of(tensor_type: Any) -> list[int | str | None] | None:
    if not tensor_type.HasField("shape"):
        return None
    return [d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in tensor_type.shape.dim]


def infer(model: Any, bound: Mapping[str, tuple[int, ...]]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(value name -> TypeProto, value name -> content of the small values known without the inputs).

    Shape inference runs on a copy with the inputs bound and the weights left out. Shape arithmetic it cannot
    follow (Shape -> Gather -> Slice, as older exporters write it) is evaluated with ONNX Runtime and folded into
    constants, and inference runs again, until nothing more folds."""
    onnx = require("onnx", "capture")
    light = onnx.ModelProto()
    light.CopyFrom(model)
    g = light.graph
    for t in g.initializer:  # inference reads small constants (shapes, axes) only; big ones keep their dims
        if t.data_location != onnx.TensorProto.EXTERNAL and len(t.raw_data) > MAX_DATA_BYTES:
            t.ClearField("raw_data")
            t.data_location = onnx.TensorProto.EXTERNAL
            entry = t.external_data.add()
            entry.key, entry.value = "location", "xsched-unread"
    for inp in g.input:
        if inp.name in bound:
            shape = inp.type.tensor_type.shape
            shape.ClearField("dim")
            for d in bound[inp.name]:
                shape.dim.add().dim_value = d
    del g.value_info[:]
    for out in g.output:  # exporters write symbolic output dims: inference derives them from the inputs instead
        out.type.tensor_type.ClearField("shape")
    weights = {t.name: t for t in model.graph.initializer}
    known: dict[str, Any] = {}
    for _ in range(MAX_FOLD_ROUNDS):
        types = _inferred_types(light, strict=False)
        found = _fold(light, types, weights, known)
        if not found:
            break
        known.update(found)
    types = _inferred_types(light, strict=True)  # the error of a node that still fails, named
    for t in model.graph.initializer:
        types[t.name] = onnx.helper.make_tensor_type_proto(t.data_type, list(t.dims))
    return types, known


def _inferred_types(model: Any, *, strict: bool) -> dict[str, Any]:
    onnx = require("onnx", "capture")
    try:
        inferred = onnx.shape_inference.infer_shapes(model, check_type=True, strict_mode=strict, data_prop=True)
    except Exception as e:  # InferenceError, ValidationError
        raise CaptureError(f"shape inference failed: {one_line(e)}", op=named_node(str(e))) from e
    g = inferred.graph
    types = {vi.name: vi.type for vi in (*g.input, *g.value_info, *g.output)}
    for t in model.graph.initializer:
        types[t.name] = onnx.helper.make_tensor_type_proto(t.data_type, list(t.dims))
    return types


def _nbytes(tp: Any) -> int | None:
    """Bytes of a fully known tensor type, else None."""
    if tp is None or not tp.HasField("tensor_type"):
        return None
    dims = dims_of(tp.tensor_type)
    size = ELEM_TYPES.get(tp.tensor_type.elem_type)
    if dims is None or size is None or not all(isinstance(d, int) for d in dims):
        return None
    n = size[1]
    for d in dims:
        n *= int(d)
    return n


def _fold(light: Any, types: Mapping[str, Any], weights: Mapping[str, Any], known: Mapping[str, Any]) -> dict:
    """One round: evaluate the small values computed from constants and known shapes only, and replace the
    nodes computing them with Constant nodes in `light`. Returns the new values (name -> array)."""
    onnx = require("onnx", "capture")
    nodes = list(light.graph.node)
    static = {t.name for t in light.graph.initializer}
    wanted: list[str] = []
    for n in nodes:
        ins = [v for v in n.input if v]
        if n.op_type in RANDOM_OPS or n.domain not in ("", "ai.onnx"):
            continue
        if n.op_type in ("Shape", "Size"):
            ok = _nbytes(types.get(ins[0])) is not None
        else:
            ok = all(v in static for v in ins)
        if ok:
            static.update(v for v in n.output if v)
            small = [v for v in n.output if v and (_nbytes(types.get(v)) or MAX_DATA_BYTES + 1) <= MAX_DATA_BYTES]
            wanted += [v for v in small if v not in known]
    if not wanted:
        return {}
    found = _evaluate(light, types, weights, wanted)
    replaced = []
    for n in nodes:
        outs = [v for v in n.output if v]
        if n.op_type != "Constant" and outs and all(v in found or v in known for v in outs):
            values = {**known, **found}
            replaced += [
                onnx.helper.make_node("Constant", [], [v], value=onnx.numpy_helper.from_array(values[v], v))
                for v in outs
            ]
        else:
            replaced.append(n)
    del light.graph.node[:]
    light.graph.node.extend(replaced)
    return found


def _evaluate(light: Any, types: Mapping[str, Any], weights: Mapping[str, Any], wanted: Sequence[str]) -> dict:
    """Run the nodes of `light` computing `wanted` on ONNX Runtime, each Shape/Size replaced by its value."""
    onnx, ort = require("onnx", "capture"), require("onnxruntime", "capture")
    np = require("numpy", "capture")
    producer = {v: n for n in light.graph.node for v in n.output if v}
    need: dict[int, Any] = {}
    todo = [producer[v] for v in wanted]
    while todo:
        n = todo.pop()
        if id(n) in need:
            continue
        need[id(n)] = n
        if n.op_type not in ("Shape", "Size"):
            todo.extend(producer[v] for v in n.input if v in producer)
    nodes, reads = [], set()
    for n in light.graph.node:
        if id(n) not in need:
            continue
        if n.op_type in ("Shape", "Size"):
            nodes.append(
                onnx.helper.make_node(
                    "Constant", [], [n.output[0]], value=onnx.numpy_helper.from_array(_shape_value(n, types, np))
                )
            )
        else:
            nodes.append(n)
            reads.update(v for v in n.input if v and v not in producer)
    outs = [onnx.helper.make_tensor_value_info(v, types[v].tensor_type.elem_type, None) for v in wanted]
    g = onnx.helper.make_graph(nodes, "static", [], outs, [weights[v] for v in sorted(reads) if v in weights])
    m = onnx.helper.make_model(g, opset_imports=light.opset_import, ir_version=light.ir_version)
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.log_severity_level = 3
    try:
        arrays = ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(wanted, {})
    except Exception as e:  # an op ORT cannot run: these values stay unknown (profiling uses zeros for them)
        log.warning("constant values not evaluated (%s)", one_line(e))
        return {}
    return {v: np.asarray(a) for v, a in zip(wanted, arrays)}


def _shape_value(node: Any, types: Mapping[str, Any], np: Any) -> Any:
    dims = [int(d) for d in dims_of(types[node.input[0]].tensor_type) or ()]
    if node.op_type == "Size":
        return np.array(int(np.prod(dims, dtype=np.int64)), dtype=np.int64)
    at = {a.name: a.i for a in node.attribute}
    return np.array(dims[at.get("start", 0) : at["end"] if "end" in at else None], dtype=np.int64)
