"""How an op of a captured ONNX graph is run: its call encoding, element types, and ONNX models of a run of ops.

An ONNX op's `call` is `{"format": "onnx", "domain": "", "op_type": "Conv", "opsets": {"": 20},
"attributes": <base64 NodeProto holding only the attributes>, "args": [{"ref": value} | None, ...],
"outs": [{"ref": value} | None, ...]}`: positional inputs and outputs with None for an omitted optional one.
It holds no names beyond the value refs, so ops that differ only in names share one profile signature.
Values carry `dtype` (torch-style names) and, when their content is known without the model's inputs and small
(shape tensors, axes, constant indices), that content in `extra["data"]` (base64, little-endian).
"""

from __future__ import annotations

import base64
import importlib
from collections.abc import Iterable, Mapping, Sequence
from types import ModuleType
from typing import Any

from xsched.contracts.graph import Graph, Op, Value
from xsched.errors import XschedError

FORMAT = "onnx"
# ONNX TensorProto element type -> (dtype name as torch spells it, bytes per element)
ELEM_TYPES: dict[int, tuple[str, int]] = {
    1: ("float32", 4),
    2: ("uint8", 1),
    3: ("int8", 1),
    4: ("uint16", 2),
    5: ("int16", 2),
    6: ("int32", 4),
    7: ("int64", 8),
    9: ("bool", 1),
    10: ("float16", 2),
    11: ("float64", 8),
    12: ("uint32", 4),
    13: ("uint64", 8),
    14: ("complex64", 8),
    15: ("complex128", 16),
    16: ("bfloat16", 2),
    17: ("float8_e4m3fn", 1),
    18: ("float8_e4m3fnuz", 1),
    19: ("float8_e5m2", 1),
    20: ("float8_e5m2fnuz", 1),
}
ELEM_TYPE_OF = {name: t for t, (name, _) in ELEM_TYPES.items()}
FLOATING = frozenset({"float32", "float16", "float64", "bfloat16", "complex64", "complex128"})
# nodes whose ONNX Runtime kernels write their output into their input's memory (in a session they move no data)
ALIAS_OPS = frozenset({"Reshape", "Squeeze", "Unsqueeze", "Flatten", "Identity"})
# nodes that draw random numbers: running one again gives other numbers, so a plan may not recompute them
RANDOM_OPS = frozenset(
    {"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Multinomial", "Bernoulli"}
)


def require(module: str, stage: str = "onnx") -> ModuleType:
    """`onnx` or `onnxruntime`, or a one-line error saying how to install them."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise XschedError(f"{module} is not installed: pip install 'xsched[onnx]' ({e})", stage=stage) from e


def is_onnx_op(op: Op) -> bool:
    return isinstance(op.call, Mapping) and op.call.get("format") == FORMAT


def op_type(op: Op) -> str:
    return str(op.call["op_type"]) if is_onnx_op(op) else op.target


# ---- the call encoding ----
def encode_call(node: Any, opsets: Mapping[str, int]) -> dict[str, Any]:
    """The call of one NodeProto (a node without subgraphs): self-contained, free of node and value names."""
    onnx = require("onnx", "capture")
    attrs = onnx.NodeProto()
    attrs.attribute.extend(node.attribute)
    domain = "" if node.domain == "ai.onnx" else node.domain
    needed = {d: int(v) for d, v in opsets.items() if d in ("", domain)}
    return {
        "format": FORMAT,
        "domain": domain,
        "op_type": node.op_type,
        "opsets": dict(sorted(needed.items())),
        "attributes": base64.b64encode(attrs.SerializeToString(deterministic=True)).decode(),
        "args": [{"ref": v} if v else None for v in node.input],
        "outs": [{"ref": v} if v else None for v in node.output],
    }


def decode_node(op: Op, name: str | None = None) -> Any:
    """The NodeProto an ONNX op's call describes, with value ids as tensor names."""
    onnx = require("onnx")
    if not is_onnx_op(op):
        raise XschedError("op has no ONNX call: it was not captured from an ONNX model", stage="execute", op=op.id)
    call = op.call
    node = onnx.NodeProto()
    node.ParseFromString(base64.b64decode(call["attributes"]))
    node.op_type, node.domain, node.name = call["op_type"], call["domain"], name or op.id
    node.input.extend(a["ref"] if a else "" for a in call["args"])
    node.output.extend(o["ref"] if o else "" for o in call["outs"])
    return node


# ---- values ----
def itemsize(elem_type: int, where: str) -> tuple[str, int]:
    if elem_type not in ELEM_TYPES:
        onnx = require("onnx", "capture")
        name = onnx.TensorProto.DataType.Name(elem_type) if elem_type in onnx.TensorProto.DataType.values() else "?"
        raise XschedError(f"{where} has element type {name} ({elem_type}), which xsched cannot size", stage="capture")
    return ELEM_TYPES[elem_type]


def np_dtype(dtype: str) -> Any:
    onnx = require("onnx")
    return onnx.helper.tensor_dtype_to_np_dtype(ELEM_TYPE_OF[dtype])


def encode_array(arr: Any) -> str:
    np = require("numpy")
    return base64.b64encode(np.asarray(arr, order="C").astype(arr.dtype.newbyteorder("<")).tobytes()).decode()


def static_array(v: Value) -> Any | None:
    """A value's known content (shape tensors, axes, constant indices), or None."""
    data = v.extra.get("data")
    if data is None or v.dtype is None or v.shape is None:
        return None
    np = require("numpy")
    dt = np.dtype(np_dtype(v.dtype)).newbyteorder("<")
    return np.frombuffer(base64.b64decode(data), dtype=dt).reshape(v.shape).astype(dt.newbyteorder("="))


def example_array(graph: Graph, vid: str, rng: Any) -> Any:
    """An array for value `vid` when no real one is given (profiling, `xsched run`): its known content (shapes,
    axes, indices), else normal floats, else zeros (an index 0 is in range for every gather)."""
    np = require("numpy")
    v = graph.value[vid]
    known = static_array(v)
    if known is not None:
        return known
    dtype = np_dtype(v.dtype or "float32")
    if v.dtype in FLOATING:
        return rng.standard_normal(v.shape or ()).astype(dtype)
    return np.zeros(v.shape or (), dtype=dtype)


def value_info(v: Value, name: str | None = None) -> Any:
    onnx = require("onnx")
    if v.dtype not in ELEM_TYPE_OF or v.shape is None:
        raise XschedError("value has no ONNX type (dtype and shape)", stage="execute", value=v.id)
    return onnx.helper.make_tensor_value_info(name or v.id, ELEM_TYPE_OF[v.dtype], list(v.shape))


def external_initializer(v: Value) -> Any:
    """A TensorProto that names its data without holding it: the session gets it with add_external_initializers."""
    onnx = require("onnx")
    t = onnx.TensorProto(name=v.id, data_type=ELEM_TYPE_OF[v.dtype or ""], dims=list(v.shape or ()))
    t.data_location = onnx.TensorProto.EXTERNAL
    entry = t.external_data.add()
    entry.key, entry.value = "location", f"xsched-memory:{v.id}"
    return t


# ---- models of a run of ops ----
def build_model(
    graph: Graph,
    op_ids: Sequence[str],
    inputs: Iterable[str],
    outputs: Iterable[str],
    *,
    initializers: Mapping[str, Any] | None = None,
    external: Iterable[str] = (),
    renames: Sequence[Mapping[str, str]] | None = None,
    output_names: Sequence[str] | None = None,
    name: str = "xsched",
) -> Any:
    """An ONNX model of the ops `op_ids` (in that order): `inputs` are its graph inputs, `outputs` its outputs,
    `initializers` (value id -> array) constants held in the model, `external` constants whose memory the
    session is given (external_initializer). `renames[k]` renames values in the k-th node (an op computed twice
    in one model writes its second outputs under new names); `output_names` are the outputs' names there."""
    onnx = require("onnx")
    ops = [graph.op[o] for o in op_ids]
    opsets: dict[str, int] = {"": 1}
    for op in ops:
        for d, ver in op.call["opsets"].items():
            opsets[d] = max(opsets.get(d, 1), int(ver))
    nodes = []
    for k, op in enumerate(ops):
        node = decode_node(op, f"{op.id}#{k}" if renames else op.id)
        ren = renames[k] if renames else {}
        if ren:
            node.input[:] = [ren.get(v, v) for v in node.input]
            node.output[:] = [ren.get(v, v) for v in node.output]
        nodes.append(node)
    outputs = list(outputs)
    names = list(output_names) if output_names is not None else outputs
    outs = [value_info(graph.value[v], n) for v, n in zip(outputs, names)]
    inits = [onnx.numpy_helper.from_array(a, name=v) for v, a in (initializers or {}).items()]
    inits += [external_initializer(graph.value[v]) for v in external]
    g = onnx.helper.make_graph(nodes, name, [value_info(graph.value[v]) for v in inputs], outs, initializer=inits)
    imports = [onnx.helper.make_opsetid(d, v) for d, v in sorted(opsets.items())]
    model = onnx.helper.make_model(g, opset_imports=imports, producer_name="xsched")
    model.ir_version = onnx.helper.find_min_ir_version_for(imports, ignore_unknown=True)
    return model


def op_model(graph: Graph, op: Op, params: Iterable[str] = ()) -> tuple[Any, list[str]]:
    """One op alone: (its model, the names of the inputs it is fed). Its inputs among `params` become
    initializers, as in a session of the whole model (where the provider may prepack them): in the model when
    their content is known (shape tensors, axes), else given to the session (external_initializer)."""
    params = set(params)
    ins = list(dict.fromkeys(op.inputs))
    known = {v: static_array(graph.value[v]) for v in ins if v in params}
    inline = {v: a for v, a in known.items() if a is not None}
    external = [v for v, a in known.items() if a is None]
    fed = [v for v in ins if v not in params]
    model = build_model(graph, [op.id], fed, op.outputs, initializers=inline, external=external, name=op.id)
    return model, fed
