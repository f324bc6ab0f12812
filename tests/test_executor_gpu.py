"""The executor's CUDA path (side copy streams, pinned staging, events, record_stream) against eager PyTorch."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.testing import assert_close
from torch.utils._pytree import tree_flatten

from xsched import zoo
from xsched.capture.torch import bind_inputs, capture, unpack_outputs
from xsched.execute.executor import Executor
from xsched.execute.report import measure
from xsched.execute.wrap import wrap
from xsched.graph import Graph, Op, Value
from xsched.plan import Compute, Copy, Free, Plan, SolverInfo
from xsched.profile import DeviceInfo, LinkCost, OpCost, Profile
from xsched.solve.api import solve

pytestmark = pytest.mark.gpu
DEVICES = ("cuda:0", "cpu")


@pytest.fixture(autouse=True)
def exact_math():
    """No TF32: the comparison with eager PyTorch on the CPU is then to float32 rounding."""
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


def profile_for(graph: Graph) -> Profile:
    compute = {"cuda:0": {o.id: OpCost(1e-4) for o in graph.ops}, "cpu": {o.id: OpCost(1e-3) for o in graph.ops}}
    links = {"cpu->cuda:0": LinkCost(1e-5, 1.2e10), "cuda:0->cpu": LinkCost(1e-5, 1.2e10)}
    return Profile(graph.fingerprint, {"cuda:0": DeviceInfo("cuda"), "cpu": DeviceInfo("cpu")}, compute, links)


@pytest.mark.parametrize("name", ["resnet18", "gpt2", "vgg16"])
def test_gpu_compute_with_host_homes_matches_cpu_eager(name: str) -> None:
    """Params and inputs live on the host, every op runs on the GPU: h2d copies in, grads copied back out."""
    z = zoo.build(name, scale="tiny")
    graph = capture(z.model, z.inputs)
    homes = {v: "cpu" for v in graph.inputs}
    plan = solve(graph, profile_for(graph), {}, DEVICES, "fastest", homes=homes)
    assert any(isinstance(s, Copy) and s.dst == "cuda:0" for s in plan.steps)
    assert any(isinstance(s, Copy) and s.src == "cuda:0" for s in plan.steps)
    env = bind_inputs(graph, z.model, z.inputs)
    # eager on the GPU, same seed: dropout draws from the CUDA generator in the same order
    ref = copy.deepcopy(z.model).cuda()
    torch.manual_seed(0)
    outs = [o for o in tree_flatten(ref(*[x.cuda() for x in z.inputs]))[0] if isinstance(o, torch.Tensor)]
    diff = [o for o in outs if o.requires_grad]
    torch.autograd.backward(diff, [torch.ones_like(o) for o in diff])
    ex = Executor(graph, plan)
    for trace in (False, True):  # concurrent lanes, then one step at a time
        torch.manual_seed(0)
        got = unpack_outputs(graph, ex(env, trace=trace).outputs)
        for a, b in zip(got.outputs, outs):
            assert_close(a.cpu(), b.detach().cpu(), rtol=1e-4, atol=1e-5)
        for n, p in ref.named_parameters():
            assert got.grads[n].device.type == "cpu", f"grad of {n} must end on its param's home"
            assert_close(got.grads[n], p.grad.cpu(), rtol=1e-4, atol=1e-5)
    ex.close()


def test_gpu_free_right_after_copy_out_keeps_the_data() -> None:
    """A large GPU value copied to the host and freed on the GPU in the next step, while a new allocation
    on the GPU would reuse its memory at once: the copy must still read the right numbers."""
    n = 1 << 24
    values = (
        Value("x", n * 4, "input", (n,), "float32", name="input:0"),
        Value("a", n * 4, "activation", (n,), "float32"),
        Value("b", n * 4, "activation", (n,), "float32"),
    )
    ops = (
        Op("exp", "aten.exp.default", ("x",), ("a",), "fwd", call={"args": [{"ref": "x"}], "outs": [[]]}),
        Op("neg", "aten.neg.default", ("x",), ("b",), "fwd", call={"args": [{"ref": "x"}], "outs": [[]]}),
    )
    graph = Graph("free", values, ops, ("a", "b"))
    steps = (Compute("exp", "cuda:0"), Copy("a", "cuda:0", "cpu"), Free("a", "cuda:0"), Compute("neg", "cuda:0"))
    plan = Plan(graph.fingerprint, {}, {"x": "cuda:0"}, steps, SolverInfo("hand"))
    x = torch.randn(n, device="cuda")
    ex = Executor(graph, plan)
    out = ex({"x": x}).outputs
    torch.cuda.synchronize()
    assert out["a"].device.type == "cpu"
    assert_close(out["a"], x.exp().cpu())
    assert_close(out["b"], -x)
    ex.close()


def test_wrap_on_gpu_trains_like_eager() -> None:
    torch.manual_seed(0)
    eager = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(64, 64), nn.BatchNorm1d(64), nn.ReLU())]).cuda()
    model = copy.deepcopy(eager)
    x = torch.randn(512, 64, device="cuda")
    w = wrap(model, (x,), {"cuda:0": "60%"})
    for m in (eager, w):
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        for _ in range(3):
            opt.zero_grad()
            m(x).square().mean().backward()
            opt.step()
    for p, q in zip(model.parameters(), eager.parameters()):
        assert_close(p, q, rtol=1e-4, atol=1e-5)
    for p, q in zip(model.buffers(), eager.buffers()):
        assert_close(p, q, rtol=1e-4, atol=1e-5)


def test_report_uses_cuda_memory_statistics() -> None:
    z = zoo.build("resnet18", scale="tiny")
    graph = capture(z.model, z.inputs)
    plan = solve(graph, profile_for(graph), {}, DEVICES, "fastest", homes={v: "cpu" for v in graph.inputs})
    r = measure(graph, plan, bind_inputs(graph, z.model, z.inputs), profile_for(graph), iters=2, warmup=1)
    assert r.peak_source["cuda:0"] == "cuda max_memory_allocated"
    assert r.peak_bytes["cuda:0"] > 0
    assert "cuda:0" in r.table()
