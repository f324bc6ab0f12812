"""ONNX models for the ONNX tests: zoo models exported by torch.onnx (once per process), and hand-built graphs."""

from __future__ import annotations

import functools
import io
import logging
import warnings

import pytest
import torch

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
from onnx import TensorProto, helper  # noqa: E402

from xsched.zoo import build  # noqa: E402


@functools.cache
def _export(name: str, scale: str, batch: int | None, how: str, dynamic: bool) -> bytes:
    z = build(name, scale=scale, batch=batch)
    model = z.model.eval()
    inputs = z.inputs[:1] if name == "gpt2" else z.inputs  # gpt2's targets only feed its loss
    names = [f"in{i}" for i in range(len(inputs))]
    axes = {n: {0: "batch"} for n in names} if dynamic else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        logging.disable(logging.WARNING)  # the dynamo exporter's notes on torchvision ops it skips
        try:
            if how == "dynamo":
                dims = {n: {0: torch.export.Dim("batch")} for n in names} if dynamic else None
                return torch.onnx.export(
                    model, inputs, input_names=names, dynamo=True, dynamic_shapes=dims, verbose=False
                ).model_proto.SerializeToString()
            buf = io.BytesIO()
            torch.onnx.export(model, inputs, buf, input_names=names, dynamic_axes=axes, dynamo=False)
            return buf.getvalue()
        finally:
            logging.disable(logging.NOTSET)


def zoo_onnx(name: str, scale: str = "tiny", batch: int | None = None, how: str = "legacy", dynamic: bool = False):
    """A zoo model in eval mode exported to ONNX (inference): "legacy" is the TorchScript exporter (fast),
    "dynamo" the torch.export one (onnxscript). A fresh ModelProto each call."""
    return onnx.load_from_string(_export(name, scale, batch, how, dynamic))


def chain_model(n: int = 6, size: int = 64, skip: bool = True):
    """x -> Relu/Neg/Sigmoid chain of `n` nodes (matmul with a weight first); with `skip`, the first activation is
    added back at the end (a value held across the whole chain: something to recompute or park), then the sum is
    scaled by a 0-d weight."""
    w = helper.make_tensor("w", TensorProto.FLOAT, [size, size], [((i * 7) % 13 - 6) / 13 for i in range(size * size)])
    nodes = [helper.make_node("MatMul", ["x", "w"], ["a0"], name="mm")]
    kinds = ["Relu", "Neg", "Sigmoid"]
    for i in range(1, n):
        nodes.append(helper.make_node(kinds[i % 3], [f"a{i - 1}"], [f"a{i}"], name=f"n{i}"))
    last = f"a{n - 1}"
    if skip:
        nodes.append(helper.make_node("Add", [last, "a0"], ["z"], name="skip"))
        nodes.append(helper.make_node("Mul", ["z", "s"], ["y"], name="scale"))  # a 0-d weight
        last = "y"
    s = helper.make_tensor("s", TensorProto.FLOAT, [], [0.5])
    graph = helper.make_graph(
        nodes,
        "chain",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [size, size])],
        [helper.make_tensor_value_info(last, TensorProto.FLOAT, [size, size])],
        [w, s] if skip else [w],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
