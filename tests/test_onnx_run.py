"""Placed execution on ONNX Runtime: plans from xsched.solve (eager, recomputing, two logical devices with copies)
give the outputs of one plain session; the stores hold what the simulator says; budgets hold."""

from __future__ import annotations

import numpy as np
import pytest
from onnx_models import chain_model, onnx, ort, zoo_onnx

from xsched.capture.onnx import capture_model
from xsched.contracts.graph import Graph
from xsched.contracts.plan import Compute, Copy, Free, Plan, place_frees
from xsched.contracts.result import SolveResult
from xsched.devices import get_device
from xsched.errors import XschedError
from xsched.execute.ort_executor import OrtExecutor, plain_session
from xsched.execute.ort_measure import example_feeds, measure_onnx
from xsched.profiling.model import cost_profile
from xsched.simulate import simulate
from xsched.solve.api import solve
from xsched.solve.options import SolverOptions
from xsched.solve.reference import eager_plan


def _check(captured, plan: Plan, optimization: str = "disabled") -> OrtExecutor:
    """Placed outputs equal a plain session's (bit for bit with optimisations off on both); after each action the
    stores of devices outside a segment hold the bytes the simulator says; the executor's peak is in budget."""
    g = captured.graph
    sim = simulate(g, plan, check_budgets=True)  # the budget holds in the simulator
    ex = OrtExecutor(g, plan, captured.model, optimization=optimization)
    feeds = example_feeds(g, seed=3)
    run = ex.run(feeds, trace=True)
    want = plain_session(captured.model, ["ort:cpu"], optimization).run(g.outputs, feeds)
    for v, w in zip(g.outputs, want):
        got = run.outputs[v].numpy()
        if optimization == "disabled":
            np.testing.assert_array_equal(got, w)
        else:  # fusions differ at segment boundaries
            np.testing.assert_allclose(got, w, rtol=1e-5, atol=1e-5)
    assert run.held_after and all(
        b == sim.resident_after[at][d] for at, held in run.held_after for d, b in held.items()
    )
    for d, b in ex.peak_bytes.items():
        assert sim.peak_bytes[d] <= b <= plan.budgets.get(d, b)
    return ex


def _between(g: Graph, frac: float) -> int:
    """A budget `frac` of the way from the graph inputs' bytes to the eager peak."""
    inputs = sum(g.value[v].nbytes for v in g.inputs)
    return int(inputs + frac * (max(simulate(g, eager_plan(g, "d")).peak_bytes.values()) - inputs))


@pytest.mark.parametrize(
    ("name", "how"), [("resnet18", "legacy"), ("gpt2", "dynamo"), ("mlp_mixer", "legacy"), ("unet", "dynamo")]
)
def test_eager_plan_is_one_session(name, how):
    c = capture_model(zoo_onnx(name, how=how))
    ex = _check(c, eager_plan(c.graph, "ort:cpu"), optimization="all")
    assert len(ex.segments) == 1


def test_recomputation_at_a_reduced_budget():
    """The legacy transformer computes its attention mask once for every layer: the checkpoint plan recomputes it;
    an op computed twice in one session writes under a second name."""
    c = capture_model(zoo_onnx("transformer"))
    g = c.graph
    budget = _between(g, 0.9)
    plan = solve(g, cost_profile(g, ["ort:cpu"]), {"ort:cpu": budget}, method="checkpoint")
    computes = sum(isinstance(s, Compute) for s in plan.steps)
    assert computes > len(g.ops) and plan.predicted.peak_bytes["ort:cpu"] <= budget
    ex = _check(c, plan)
    assert any(r for seg in ex.segments for r in seg.renames)


def test_two_logical_devices_with_copies():
    """A plan that parks values on a second logical CPU and fetches them back: sessions split at the copies."""
    c = capture_model(zoo_onnx("gpt2", batch=16))
    g = c.graph
    devices = ["ort:cpu:0", "ort:cpu:1"]
    budgets = {"ort:cpu:0": _between(g, 0.9), "ort:cpu:1": _between(g, 0.5) - _between(g, 0.0)}
    plan = solve(g, cost_profile(g, devices), budgets, devices, method="offload")
    assert any(isinstance(s, Copy) for s in plan.steps)
    ex = _check(c, plan)
    assert len(ex.segments) > 1 and ex.cuts  # holding the inputs of some sessions to their end would not fit


def test_auto_plan_on_two_devices():
    c = capture_model(chain_model(n=8))
    g = c.graph
    devices = ["ort:cpu:0", "ort:cpu:1"]
    plan = solve(
        g,
        cost_profile(g, devices),
        {"ort:cpu:0": "80%", "ort:cpu:1": "60%"},
        devices,
        options=SolverOptions(time_limit_s=5),
    )
    _check(c, plan)


def _manual(g: Graph, steps, homes=None, budgets=None) -> Plan:
    homes = homes or {v: "ort:cpu:0" for v in g.inputs}
    return Plan(
        g.fingerprint, budgets or {}, homes, tuple(place_frees(g, steps, homes)), SolveResult("test", "heuristic")
    )


def test_segment_rules_on_a_hand_made_plan():
    """Recompute within a session (renamed), a copy into the device mid-run, a fed value freed mid-segment
    (deferred, then at a budget that forbids it, ending the segment): the outputs stay the plain session's."""
    c = capture_model(chain_model(n=6))
    g = c.graph
    ops = [o.id for o in g.ops]  # mm, n1..n5, skip, scale
    a, b = "ort:cpu:0", "ort:cpu:1"
    steps = [
        Compute("mm", a),
        Compute("n1", a),
        Copy("a1", a, b),
        Compute("n2", b),
        Compute("n3", b),
        Copy("x", a, b),
        Copy("w", a, b),
        Copy("s", a, b),
        Compute("mm", b),
        Compute("n4", b),
        Compute("n5", b),
        Compute("mm", b),
        Compute("skip", b),
        Compute("scale", b),
        Copy("y", b, a),
    ]
    assert {s.op for s in steps if isinstance(s, Compute)} == set(ops)
    plan = _manual(g, steps)
    ex = _check(c, plan)
    assert [s.ops for s in ex.segments] == [("mm", "n1"), ("n2", "n3"), ("mm", "n4", "n5", "mm", "skip", "scale")]
    assert "s" in ex.segments[2].feeds  # the 0-d weight, copied: bound from the store as a 0-d OrtValue
    assert ex.segments[2].renames[3] == {"a0": "a0@3"} and ex.segments[2].renames[4] == {"a0": "a0@3"}
    assert not ex.cuts and ex.peak_bytes["ort:cpu:1"] > simulate(g, plan).peak_bytes["ort:cpu:1"]  # deferred
    tight = _manual(g, steps, budgets=dict(simulate(g, plan).peak_bytes))
    ex = _check(c, tight)
    assert ex.cuts and len(ex.segments) > 2


def test_feeds_and_values_keep_their_shapes():
    """A fed input of another shape is named; a 0-d weight stays 0-d on its device and through a copy."""
    c = capture_model(chain_model())
    ex = OrtExecutor(c.graph, eager_plan(c.graph, "ort:cpu"), c.model)
    with pytest.raises(XschedError, match=r"fed with shape \[2, 64\], the graph's is \[64, 64\]") as e:
        ex.run({"x": np.zeros((2, 64), np.float32)})
    assert e.value.value == "x"
    a, b = get_device("ort:cpu:0"), get_device("ort:cpu:1")
    assert ex.params["s"].shape() == [] and a.transfer(a.put(np.float32(2.0)), b).shape() == []


def test_random_node_cannot_be_recomputed():
    TensorProto, helper = onnx.TensorProto, onnx.helper

    nodes = [
        helper.make_node("RandomUniformLike", ["x"], ["r"], name="rand"),
        helper.make_node("Add", ["x", "r"], ["y"], name="add"),
    ]
    vi = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [4]) for n in ("x", "y")]
    model = helper.make_model(
        helper.make_graph(nodes, "g", vi[:1], vi[1:]), opset_imports=[helper.make_opsetid("", 17)]
    )
    c = capture_model(model)
    steps = [Compute("rand", "ort:cpu"), Free("r", "ort:cpu"), Compute("rand", "ort:cpu"), Compute("add", "ort:cpu")]
    plan = Plan(c.graph.fingerprint, {}, {"x": "ort:cpu"}, tuple(steps), SolveResult("test", "heuristic"))
    with pytest.raises(XschedError, match="RandomUniformLike recomputed: ONNX Runtime cannot draw its numbers") as e:
        OrtExecutor(c.graph, plan, c.model)
    assert e.value.op == "rand" and e.value.step == 2 and "\n" not in str(e.value)


def test_plan_devices_must_be_onnx_runtime_devices():
    c = capture_model(chain_model())
    with pytest.raises(XschedError, match="plan device cpu runs on cpu, not an ONNX Runtime device") as e:
        OrtExecutor(c.graph, eager_plan(c.graph, "cpu"), c.model)
    assert "\n" not in str(e.value)
    ex = OrtExecutor(c.graph, eager_plan(c.graph, "gpu"), c.model, devices={"gpu": "ort:cpu"})
    assert ex.device_names == {"gpu": "ort:cpu"}


def test_symbolic_batch_through_the_session_api(tmp_path):
    """xsched.onnx.session with ONNX Runtime's run signature: a plan per batch size, outputs as a plain session's."""
    import xsched.onnx

    model = zoo_onnx("resnet18", dynamic=True)
    plain = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    s = xsched.onnx.session(
        model, {"ort:cpu": "100%"}, ["CPUExecutionProvider"], profile="model", profile_dir=str(tmp_path)
    )
    out = s.run(None, {"in0": np.ones((3, 3, 32, 32), np.float32)})
    for batch in (3, 5):
        x = np.random.default_rng(batch).standard_normal((batch, 3, 32, 32)).astype(np.float32)
        got, want = s.run(None, {"in0": x}), plain.run(None, {"in0": x})
        np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-5)
    assert out[0].shape == (3, 10) and len(s.placed) == 2 and s.plan.budgets
    name = s.output_names[0]
    assert s.run([name], {"in0": x})[0].shape == (5, 10)
    for feed, message in [
        ({}, "missing inputs in0"),
        ({"in0": x, "z": x}, "unknown inputs z"),
        ({"in0": x.astype(np.float64)}, "input in0 is float64, the model wants float32"),
    ]:
        with pytest.raises(XschedError, match=message):
            s.run(None, feed)
    with pytest.raises(XschedError, match="unknown output nope"):
        s.run(["nope"], {"in0": x})


def test_measured_beside_a_plain_session():
    c = capture_model(chain_model())
    plan = eager_plan(c.graph, "ort:cpu")
    r = measure_onnx(c.graph, plan, c.model, iters=2, warmup=1)
    assert r.max_abs_diff == 0.0 and r.segments == 1 and r.time_s > 0 and r.plain_time_s > 0
    assert "plain session" in r.table()


@pytest.mark.gpu
def test_placed_on_cuda_and_cpu():
    """Weights on the GPU, nodes on both providers, OrtValues copied between them: a plain session's outputs."""
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        pytest.skip("onnxruntime without the CUDA provider (pip install onnxruntime-gpu)")
    c = capture_model(chain_model(n=8))
    g = c.graph
    gpu, cpu = "ort:cuda:0", "ort:cpu"
    steps = [
        Compute("mm", gpu),
        Compute("n1", gpu),
        Copy("a1", gpu, cpu),
        Compute("n2", cpu),
        Compute("n3", cpu),
        Copy("a3", cpu, gpu),
    ] + [Compute(o.id, gpu) for o in g.ops[4:]]
    plan = Plan(
        g.fingerprint,
        {},
        {v: gpu for v in g.inputs},
        place_frees(g, steps, {v: gpu for v in g.inputs}),
        SolveResult("test", "heuristic"),
    )
    ex = OrtExecutor(g, plan, c.model)
    feeds = example_feeds(g)
    got = ex.run(feeds, trace=True).outputs
    want = plain_session(c.model, [gpu, cpu]).run(g.outputs, feeds)
    for v, w in zip(g.outputs, want):
        np.testing.assert_allclose(got[v].numpy(), w, rtol=1e-4, atol=1e-4)
    assert [s.device for s in ex.segments] == [gpu, cpu, gpu]
