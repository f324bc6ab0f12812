"""ONNX capture: exported zoo models become inference graphs whose sizes are what ONNX Runtime computes, and every
malformed or unsupported file is a one-line error naming the node or the problem."""

from __future__ import annotations

import numpy as np
import pytest
from onnx_models import chain_model, onnx, ort, zoo_onnx

from xsched.capture.onnx import capture_model, capture_onnx, parse_shape
from xsched.contracts.onnx_ops import ELEM_TYPE_OF, build_model, example_array, np_dtype
from xsched.errors import CaptureError

TensorProto, helper = onnx.TensorProto, onnx.helper


def _all_values(model, graph):
    """Every value the model computes, by running it with all of them as outputs (no optimisation)."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    names = [v for o in graph.ops for v in o.outputs if v not in graph.outputs]
    # declared without shapes: ONNX Runtime checks the element types and the arrays show the shapes
    m.graph.output.extend(helper.make_tensor_value_info(v, ELEM_TYPE_OF[graph.value[v].dtype], None) for v in names)
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    feeds = {v: example_array(graph, v, rng) for v in graph.inputs if graph.value[v].kind == "input"}
    return dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))


@pytest.mark.parametrize(("name", "how"), [("resnet18", "legacy"), ("gpt2", "dynamo"), ("transformer", "legacy")])
def test_sizes_are_what_onnx_runtime_computes(name, how):
    c = capture_model(zoo_onnx(name, how=how))
    g = c.graph
    assert all(o.phase == "fwd" and o.target.startswith("onnx::") for o in g.ops)
    params = {t.name for t in c.model.graph.initializer}
    assert {v for v in g.inputs if g.value[v].kind == "param"} <= params
    model_inputs = [g.value[v].name for v in g.inputs if g.value[v].kind == "input"]
    assert model_inputs == [f"input:{k}" for k in range(len(model_inputs))] and model_inputs
    for v, arr in _all_values(c.model, g).items():
        want = g.value[v]
        assert (tuple(arr.shape), str(arr.dtype), arr.nbytes) == (
            want.shape,
            str(np.dtype(np_dtype(want.dtype))),
            want.nbytes,
        ), v


def test_each_call_runs_its_op_alone():
    """The call encoding is enough to run an op alone: one node's model gives what the whole model gives."""
    model = zoo_onnx("resnet18")
    g = capture_onnx(model)
    values = _all_values(model, g)
    for op in g.ops[:12]:
        m = build_model(
            g,
            [op.id],
            list(dict.fromkeys(op.inputs)),
            op.outputs,
            initializers={
                v: onnx.numpy_helper.to_array(t) for t in model.graph.initializer for v in [t.name] if v in op.inputs
            },
        )
        sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
        feeds = {i.name: values[i.name] for i in sess.get_inputs()}
        for v, got in zip(op.outputs, sess.run(op.outputs, feeds)):
            np.testing.assert_allclose(got, values[v], rtol=1e-5, atol=1e-6)


def test_older_exports_shape_arithmetic_is_folded():
    """The legacy exporter computes Slice bounds from Shape nodes: capture evaluates them and sizes everything;
    small constant values (Reshape targets) carry their content for profiling."""
    g = capture_onnx(zoo_onnx("transformer"))
    reshapes = [o for o in g.ops if o.call["op_type"] == "Reshape"]
    assert reshapes and all("data" in g.value[o.inputs[1]].extra for o in reshapes)


def test_symbolic_batch_is_bound_from_shapes_or_inputs():
    model = zoo_onnx("resnet18", dynamic=True)
    with pytest.raises(CaptureError, match=r"input in0 has symbolic dimension\(s\) batch") as e:
        capture_onnx(model)
    assert "\n" not in str(e.value) and e.value.value == "in0"
    g = capture_onnx(model, {"in0": (3, 3, 32, 32)})
    assert g.value["in0"].shape == (3, 3, 32, 32) and g.value[g.outputs[0]].shape == (3, 10)
    assert capture_onnx(model, inputs=[np.zeros((5, 3, 32, 32), np.float32)]).value[g.outputs[0]].shape == (5, 10)
    assert parse_shape("3x3x32x32") == (3, 3, 32, 32)
    for shapes, message in [
        ({"in0": (3, 3, 32)}, "does not match"),
        ({"x": (1,)}, "not an input of the model"),
        ({"in0": (3, 4, 32, 32)}, "does not match"),
    ]:
        with pytest.raises(CaptureError, match=message):
            capture_onnx(model, shapes)
    with pytest.raises(CaptureError, match="a shape is dimensions joined by 'x'"):
        parse_shape("3,3")


def _one_node(node, opset=17, domains=(), ins=(("x", [4]),), outs=(("y", [4], TensorProto.FLOAT),)):
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info(i, TensorProto.FLOAT, s) for i, s in ins],
        [helper.make_tensor_value_info(n, t, s) for n, s, t in outs],
    )
    imports = [helper.make_opsetid("", opset)] + [helper.make_opsetid(d, 1) for d in domains]
    return helper.make_model(graph, opset_imports=imports)


def _body():
    return helper.make_graph(
        [helper.make_node("Identity", ["x"], ["z"])],
        "body",
        [],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, [4])],
    )


@pytest.mark.parametrize(
    ("model", "message", "node"),
    [
        (
            _one_node(helper.make_node("If", ["x"], ["y"], name="branch", then_branch=_body(), else_branch=_body())),
            r"node branch \(If\) holds a subgraph \((then|else)_branch, (then|else)_branch\): control flow",
            "branch",
        ),
        (_one_node(helper.make_node("Loop", ["x"], ["y"], name="repeat", body=_body())), r"repeat \(Loop\)", "repeat"),
        (
            _one_node(helper.make_node("Scan", ["x"], ["y"], name="scan", body=_body(), num_scan_inputs=1)),
            r"scan \(Scan\) holds a subgraph",
            "scan",
        ),
        (
            _one_node(
                helper.make_node("Frob", ["x"], ["y"], name="mine", domain="com.example"), domains=["com.example"]
            ),
            r"node mine \(Frob\) is in opset domain 'com.example' \(version 1\), unknown",
            "mine",
        ),
        (
            _one_node(helper.make_node("Relu", ["x"], ["y"], name="future"), opset=99),
            r"node future \(Relu\) is in opset 99 of ai.onnx; onnx .* knows opsets up to",
            "future",
        ),
        (
            _one_node(helper.make_node("Frobnicate", ["x"], ["y"], name="odd")),
            r"node odd: opset 17 of ai.onnx has no operator 'Frobnicate'",
            "odd",
        ),
        (
            _one_node(
                helper.make_node("NonZero", ["x"], ["y"], name="nz"), outs=[("y", ["a", "b"], TensorProto.INT64)]
            ),
            r"cannot infer the shape of y, output of node nz \(NonZero\): got \[1,\?\] \(its shape depends on the data\)",
            "nz",
        ),
        (
            _one_node(helper.make_node("MatMul", ["x", "w"], ["y"], name="mm"), ins=(("x", [4]), ("w", [3]))),
            r"shape inference failed: .*mm",
            "mm",
        ),
    ],
)
def test_unsupported_nodes_are_named(model, message, node):
    with pytest.raises(CaptureError, match=message) as e:
        capture_onnx(model)
    assert "\n" not in str(e.value) and str(e.value).startswith("[capture]")
    if node is not None:
        assert e.value.op == node


def test_dynamic_reshape_target_is_named():
    """A Reshape whose target is a model input: its output size depends on the data, named by its node."""
    node = helper.make_node("Reshape", ["x", "s"], ["y"], name="rs")
    graph = helper.make_graph(
        [node],
        "g",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [4]),
            helper.make_tensor_value_info("s", TensorProto.INT64, [2]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["a", "b"])],
    )
    with pytest.raises(CaptureError, match=r"cannot infer the shape of y, output of node rs \(Reshape\)") as e:
        capture_onnx(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    assert e.value.op == "rs"


def test_bad_files(tmp_path):
    good = chain_model().SerializeToString()
    cases = {
        "missing.onnx": None,
        "empty.onnx": b"",
        "junk.onnx": b"this is not an onnx model\n" * 8,
        "truncated.onnx": good[: len(good) // 2],
        "tail.onnx": good[:-3],
    }
    for name, data in cases.items():
        path = tmp_path / name
        if data is not None:
            path.write_bytes(data)
        with pytest.raises(CaptureError) as e:
            capture_onnx(path)
        text = str(e.value)
        assert "\n" not in text and str(path) in text, text
        assert any(w in text for w in ("no ONNX file", "corrupt or truncated", "holds no ONNX graph nodes")), text
    path = tmp_path / "chain.onnx"
    path.write_bytes(good)
    assert len(capture_onnx(path).ops) == 8


def test_invalid_graph_is_named():
    """A node reading a value nothing produces: the checker's error, one line."""
    model = chain_model()
    model.graph.node[2].input[0] = "nowhere"
    with pytest.raises(CaptureError, match="invalid ONNX model: .*nowhere") as e:
        capture_onnx(model)
    assert "\n" not in str(e.value)
