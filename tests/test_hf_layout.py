"""Values keep their layout: capture records the strides eager kernels give (SDPA's output is a transposed buffer),
the graph contract carries and checks them, and every op runs on the inputs profiling builds from them."""

from __future__ import annotations

import pytest
import torch
from hf_models import batches, build

from xsched.capture.torch import bind_inputs, capture
from xsched.contracts.graph import Graph, Value
from xsched.contracts.layout import layout
from xsched.contracts.torch_ops import op_input_tensors, run_op
from xsched.errors import GraphError, XschedError

pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def llama() -> tuple[Graph, torch.nn.Module, tuple]:
    torch.manual_seed(0)
    model = build("llama", "sdpa")
    inputs = batches("llama")(0)
    return capture(model, inputs), model, inputs


def test_recorded_layouts_are_the_kernels_own(llama) -> None:
    """Run the graph op by op on real tensors (the real kernels, not the fake ones capture traced): each output lies
    in memory as its value says, and SDPA's output is among the strided ones."""
    graph, model, inputs = llama
    targets = {graph.op[graph.producer[v.id]].target for v in graph.values if v.stride is not None}
    assert "aten._scaled_dot_product_flash_attention_for_cpu.default" in targets
    env = bind_inputs(graph, model, inputs)
    for op in graph.ops:
        for vid, t in zip(op.outputs, run_op(op, env)):
            env[vid] = t
            v = graph.value[vid]
            if v.stride is None:
                assert t.is_contiguous() and t.storage_offset() == 0, (op.target, vid)
            else:
                assert (tuple(t.stride()), t.storage_offset()) == layout(v), (op.target, vid)


def test_every_op_runs_on_the_inputs_profiling_builds(llama) -> None:
    """Before layouts were recorded, 8 ops after SDPA failed here with "view size is not compatible with input
    tensor's size and stride" (their folded transpose-then-view needs SDPA's real strides)."""
    graph = llama[0]
    gen = torch.Generator().manual_seed(0)
    for op in graph.ops:
        env = op_input_tensors(graph, op, "cpu", gen)
        for vid in op.inputs:
            assert (tuple(env[vid].stride()), env[vid].storage_offset()) == layout(graph.value[vid])
        run_op(op, env)


def test_layout_in_the_graph_contract() -> None:
    strided = Value("a", 96, "input", (2, 3, 4), "float32", "input:0", stride=(12, 1, 3), storage_offset=2)
    g = Graph("g", (strided,), (), ("a",))
    back = Graph.from_dict(g.to_dict())
    assert back.value["a"].stride == (12, 1, 3) and back.value["a"].storage_offset == 2
    assert back.fingerprint == g.fingerprint
    # a file without layout keys (older captures, contiguous values) loads as contiguous, its fingerprint unchanged
    plain = Graph("g", (Value("a", 96, "input", (2, 3, 4), "float32", "input:0"),), (), ("a",))
    assert "stride" not in plain.to_dict()["values"][0]
    assert layout(Graph.from_dict(plain.to_dict()).value["a"]) == ((12, 4, 1), 0)
    with pytest.raises(GraphError, match=r"stride \[1, 2\] must be one non-negative integer per dimension") as e:
        Graph("g", (Value("a", 96, "input", (2, 3, 4), "float32", stride=(1, 2)),), (), ("a",))
    assert e.value.value == "a"
    with pytest.raises(GraphError, match="storage_offset must be a non-negative integer"):
        Graph("g", (Value("a", 96, "input", (2, 3, 4), "float32", storage_offset=-1),), (), ("a",))
    with pytest.raises(GraphError, match="needs a shape"):
        Graph("g", (Value("a", 96, "input", None, "float32", stride=(1,)),), (), ("a",))


def test_an_op_no_device_runs_is_one_line_naming_it_and_the_model(llama) -> None:
    """A profile where the SDPA op failed on the CPU (as every op after it did before layouts were kept): wrap says
    which operator, where in the model and why, in one line, before any solver runs."""
    from dataclasses import replace

    from xsched import wrap
    from xsched.profiling.model import cost_profile

    graph, model, inputs = llama
    sdpa = next(o for o in graph.ops if "flash_attention_for_cpu.default" in o.target)
    costs = cost_profile(graph, ["cpu"])
    compute = {"cpu": {k: c for k, c in costs.compute["cpu"].items() if k != sdpa.id}}
    why = {"unsupported": {"cpu": {sdpa.id: "RuntimeError: no kernel\nsecond line"}}}
    broken = replace(costs, compute=compute, extra={**costs.extra, **why})
    with pytest.raises(XschedError) as e:
        wrap(model, inputs, {"cpu": "100%"}, profile=broken)
    msg = str(e.value)
    assert "\n" not in msg and e.value.op == sdpa.id
    assert "OwnLoss (LlamaForCausalLM): operator aten._scaled_dot_product_flash_attention_for_cpu.default" in msg
    assert sdpa.name in msg and "RuntimeError: no kernel" in msg


def test_strided_values_cross_devices_as_eager_lays_them_out() -> None:
    """A plan over cpu:0 and cpu:1 that copies SDPA's strided outputs between them: the copies keep the layout, so
    the ops reading them on the other device get what eager gives them, and one step equals eager's."""
    import copy

    from torch.testing import assert_close

    from xsched import wrap
    from xsched.contracts.plan import Compute, Copy

    torch.manual_seed(0)
    model = build("llama", "sdpa")
    ref = copy.deepcopy(model)
    inputs = batches("llama")(0)
    wrapped = wrap(model, inputs, {"cpu:0": "45%", "cpu:1": "100%"}, method="greedy", profile="model")
    steps = wrapped.plan.steps
    assert {s.device for s in steps if isinstance(s, Compute)} == {"cpu:0", "cpu:1"}
    assert [s for s in steps if isinstance(s, Copy) and wrapped.graph.value[s.value].stride is not None]
    got, want = wrapped(*inputs), ref(*inputs)
    got.backward()
    want.backward()
    assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert_close({k: p.grad for k, p in model.named_parameters()}, {k: p.grad for k, p in ref.named_parameters()})
