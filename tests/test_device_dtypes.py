"""Outputs whose dtype the device decides (issue 30: a bf16 layer norm's mean and rstd are float32 on CUDA, bf16 on
the CPU): the graph typed for CUDA says float32 and twice the bytes; typed for the CPU it follows the CPU kernel
(checked against it, mixed dtypes included); a CUDA-typed graph runs on logical CPUs through the executor's adapter
bit for bit as eager bf16 (the statistics round-trip exactly: made bf16, held as float32, read back as bf16); the
adapter's casts for a CUDA kernel; and `xsched train`'s plan and wrap typing alike when the devices include a GPU."""

from __future__ import annotations

import copy
import dataclasses
import importlib

import pytest
import torch
from torch import nn

from xsched import zoo
from xsched.capture.torch import bind_inputs, capture, unpack_outputs
from xsched.contracts.device_dtypes import (
    DEVICE_TYPED,
    adapted,
    agrees,
    norm_stats,
    on_device,
    typed_for,
)
from xsched.contracts.graph import Graph
from xsched.contracts.plan import Compute, Copy, Plan
from xsched.contracts.profile import DeviceInfo, LinkCost, OpCost, Profile
from xsched.devices.spec import target_device_type
from xsched.execute.executor import Executor
from xsched.execute.reference import run_plan
from xsched.solve.api import solve

pytestmark = pytest.mark.usefixtures("one_thread")

LN = "aten.native_layer_norm.default"
LN_BWD = "aten.native_layer_norm_backward.default"


def block(dtype: torch.dtype = torch.bfloat16) -> tuple[nn.Module, torch.Tensor]:
    """LayerNorm, Linear, GELU, LayerNorm: two layer norms, one of them reading a computed activation."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.LayerNorm(32), nn.Linear(32, 48), nn.GELU(), nn.LayerNorm(48)).to(dtype)
    return m, torch.randn(6, 32, dtype=dtype)


def stats(graph: Graph) -> list[str]:
    """The mean and rstd values of every native_layer_norm (outputs 1 and 2 of its return)."""
    return [v for o in graph.ops if o.target == LN for v, p in zip(o.outputs, o.call["outs"]) if p[0] in (1, 2)]


def test_typed_for_cuda_makes_the_stats_float32_and_typed_for_cpu_changes_nothing() -> None:
    m, x = block()
    plain, cuda = capture(m, (x,)), capture(m, (x,), device_type="cuda")
    assert capture(m, (x,), device_type="cpu") == plain and typed_for(plain, "cpu") is plain
    means = stats(plain)
    assert len(means) == 4  # two layer norms, a mean and an rstd each
    for v in means:
        assert plain.value[v].dtype == "bfloat16" and cuda.value[v].dtype == "float32"
        assert cuda.value[v].nbytes == 2 * plain.value[v].nbytes == 2 * 2 * 6  # one per row, 4 bytes, not 2
    assert [v for v in plain.values if v.id not in means] == [v for v in cuda.values if v.id not in means]
    assert cuda.fingerprint != plain.fingerprint and typed_for(cuda, "cuda") is cuda


def test_gpt2_bf16_typed_for_cuda_retypes_each_layer_norms_stats_only() -> None:
    """zoo gpt2 tiny (2 blocks: two layer norms each, and the final one) in bf16: 5 layer norms, 10 values
    retyped, nothing else; in fp32 typing for CUDA changes nothing."""
    z = zoo.build("gpt2", scale="tiny")
    fp32 = capture(z.model, z.inputs)
    assert typed_for(fp32, "cuda") is fp32
    model = copy.deepcopy(z.model).to(torch.bfloat16)
    plain = capture(model, z.inputs)
    cuda = typed_for(plain, "cuda")  # the pass alone: a capture for CUDA also traces dropout as CUDA runs it
    assert sum(o.target == LN for o in plain.ops) == 5 and sum(o.target == LN_BWD for o in plain.ops) == 5
    changed = [v.id for v, w in zip(plain.values, cuda.values) if v != w]
    assert sorted(changed) == sorted(stats(plain)) and len(changed) == 10
    assert all(cuda.value[v].dtype == "float32" for v in changed)


BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


# (input, weights): alike, float32 weights (mixed), none; the CPU kernel refuses bf16 weights for a half input
@pytest.mark.parametrize(("x_dtype", "w_dtype"), [(BF16, BF16), (FP16, FP16), (BF16, FP32), (FP16, FP32), (BF16, None)])
def test_typed_for_cpu_is_what_the_cpu_kernel_makes(x_dtype, w_dtype) -> None:
    """The oracle is the CPU's own kernel, run eagerly. With float32 weights (mixed types) it keeps float32
    statistics where capture's fake kernel says the input's dtype: the pass corrects that too."""
    torch.manual_seed(0)
    ln = nn.LayerNorm(16, elementwise_affine=w_dtype is not None)
    ln = ln.to(w_dtype) if w_dtype is not None else ln
    x = torch.randn(3, 16).to(x_dtype)
    w = (ln.weight, ln.bias) if w_dtype is not None else (None, None)
    _, mean, rstd = torch.ops.aten.native_layer_norm(x, [16], *w, 1e-5)
    graph = capture(ln, (x,), inference=True)
    for v in stats(graph):
        assert graph.value[v].dtype == str(mean.dtype).removeprefix("torch.") == str(rstd.dtype).removeprefix("torch.")


BN = "aten._native_batch_norm_legit_functional.default"


# (input, weights and running statistics): CPU autocast leaves batch norm in the input's dtype beside float32 ones
@pytest.mark.parametrize(
    ("x_dtype", "w_dtype", "affine"), [(BF16, FP32, True), (BF16, FP32, False), (BF16, BF16, True)]
)
def test_typed_for_cpu_batch_norm_is_what_the_cpu_kernel_makes(x_dtype, w_dtype, affine) -> None:
    """The CPU's batch norm keeps float32 statistics for a bf16 input beside float32 weights (or, without weights,
    running statistics), where the fake kernel says bf16, and its backward refuses bf16 ones: the graph says what
    the kernel, run eagerly, makes."""
    bn = nn.BatchNorm1d(8, affine=affine).to(w_dtype)
    x = torch.randn(5, 8).to(x_dtype)
    w = (bn.weight, bn.bias) if affine else (None, None)
    _, mean, invstd, *_ = torch.ops.aten._native_batch_norm_legit_functional(
        x, *w, bn.running_mean.clone(), bn.running_var.clone(), True, 0.1, 1e-5
    )
    graph = capture(bn, (x.requires_grad_(),))  # a backward, which reads the statistics, without weights too
    op = next(o for o in graph.ops if o.target == BN)
    made = [graph.value[v].dtype for v, p in zip(op.outputs, op.call["outs"]) if p[0] in (1, 2)]
    assert made == [str(mean.dtype).removeprefix("torch."), str(invstd.dtype).removeprefix("torch.")]


@pytest.mark.gpu
def test_on_a_gpu_batch_norm_makes_the_statistics_the_rule_says() -> None:
    """On a GPU (not run in this CPU session): CUDA's batch norm keeps bf16 input's statistics in float32, with
    float32 or bf16 weights, and its backward reads them so."""
    x = torch.randn(6, 8, device="cuda", dtype=BF16)
    for w_dtype in (FP32, BF16):
        w = torch.ones(8, device="cuda", dtype=w_dtype)
        stats = (torch.zeros(8, device="cuda", dtype=w_dtype), torch.ones(8, device="cuda", dtype=w_dtype))
        out, mean, invstd, *_ = torch.ops.aten._native_batch_norm_legit_functional(x, w, w, *stats, True, 0.1, 1e-5)
        rule = norm_stats("cuda", "bfloat16", str(w_dtype).removeprefix("torch."))
        assert str(mean.dtype).removeprefix("torch.") == str(invstd.dtype).removeprefix("torch.") == rule
        torch.ops.aten.native_batch_norm_backward(out, x, w, *stats, mean, invstd, True, 1e-5, [True, True, True])


def unit_profile(graph: Graph, computing: tuple[str, ...], stores: tuple[str, ...] = ()) -> Profile:
    devices = computing + stores
    compute = {d: {o.id: OpCost(1e-3) for o in graph.ops} if d in computing else {} for d in devices}
    links = {f"{a}->{b}": LinkCost(1e-4, 1e9) for a in devices for b in devices if a != b}
    return Profile(graph.fingerprint, {d: DeviceInfo("cpu") for d in devices}, compute, links, stores=stores)


def eager_run(m: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    m = copy.deepcopy(m)
    out = m(x)
    out.backward(torch.ones_like(out))
    return out.detach(), {n: p.grad for n, p in m.named_parameters()}


def assert_bitwise(got, out: torch.Tensor, grads: dict[str, torch.Tensor]) -> None:
    """Exact, not within a tolerance: the same CPU kernels on the same bf16 inputs, the statistics held as float32
    in between (bf16 -> float32 -> bf16 is exact), each parameter used once (no sum in another order)."""
    assert torch.equal(got.outputs[0], out)
    assert got.grads.keys() == grads.keys()
    for n, g in got.grads.items():
        assert g.dtype == torch.bfloat16 and torch.equal(g, grads[n]), n


@pytest.mark.parametrize("how", ["reference", "executor", "arena"])
def test_a_cuda_typed_graph_runs_on_the_cpu_bit_for_bit_as_eager(how) -> None:
    m, x = block()
    graph = capture(m, (x,), device_type="cuda")
    plan = solve(graph, unit_profile(graph, ("cpu:0",)), {}, ("cpu:0",), "eager")
    env = bind_inputs(graph, m, (x,))
    if how == "reference":
        values = run_plan(graph, plan, env)
    else:
        values = Executor(graph, plan, planned_addresses=how == "arena")(env).outputs
    assert_bitwise(unpack_outputs(graph, values), *eager_run(m, x))


def test_a_cuda_typed_graph_runs_on_two_cpus_with_a_store() -> None:
    """Parameters homed on the store cpu:1 (it runs no op), the second layer norm's forward on cpu:2 and its
    backward on cpu:0: its float32 statistics are copied from cpu:2 to cpu:0, the run overlapped on lanes."""
    m, x = block()
    graph = capture(m, (x,), device_type="cuda")
    fwd, bwd = [o.id for o in graph.ops if o.target == LN][1], [o.id for o in graph.ops if o.target == LN_BWD][0]
    computing, stores = ("cpu:0", "cpu:2"), ("cpu:1",)
    homes = {v: "cpu:1" if graph.value[v].kind == "param" else "cpu:0" for v in graph.inputs}
    profile = unit_profile(graph, computing, stores)
    slow = {"cpu:0": {fwd: OpCost(1.0)}, "cpu:2": {o.id: OpCost(1.0) for o in graph.ops if o.id != fwd}}
    compute = {d: {**c, **slow.get(d, {})} for d, c in profile.compute.items()}
    plan = solve(graph, dataclasses.replace(profile, compute=compute), {}, computing + stores, "fastest", homes=homes)
    where = {s.op: s.device for s in plan.steps if isinstance(s, Compute)}
    assert where[fwd] == "cpu:2" and where[bwd] == "cpu:0"
    copied = {s.value for s in plan.steps if isinstance(s, Copy) and s.src == "cpu:2" and s.dst == "cpu:0"}
    assert set(graph.op[fwd].outputs[1:]) <= copied and all(
        graph.value[v].dtype == "float32" for v in copied & set(stats(graph))
    )
    env = bind_inputs(graph, m, (x,))
    got = unpack_outputs(graph, Executor(graph, plan, overlap=True)(env).outputs)
    assert_bitwise(got, *eager_run(m, x))


def test_the_adapter_casts_what_a_cuda_kernel_makes_and_reads() -> None:
    """A CPU-typed graph on CUDA, with CUDA's kernels stood in for by ones that make and demand float32
    statistics (as measured on the H100): the forward's float32 mean and rstd come back bf16, the backward is
    handed float32 ones; the CPU's kernels run as they are there; other ops and devices are not wrapped."""
    x, w, b = torch.randn(4, 8).bfloat16(), torch.randn(8).bfloat16(), torch.randn(8).bfloat16()
    aten = torch.ops.aten

    def cuda_forward(*args):
        out, mean, rstd = aten.native_layer_norm(*args)
        return out, mean.float(), rstd.float()

    seen = []

    def cuda_backward(grad, x, shape, mean, rstd, *rest):
        seen.append((mean.dtype, rstd.dtype))
        return aten.native_layer_norm_backward(grad, x, shape, mean.bfloat16(), rstd.bfloat16(), *rest)

    graph_dtypes = {1: "bfloat16", 2: "bfloat16"}
    out, mean, rstd = on_device(LN, cuda_forward, "cuda", graph_dtypes)(x, [8], w, b, 1e-5)
    assert (mean.dtype, rstd.dtype) == (torch.bfloat16, torch.bfloat16)
    want = aten.native_layer_norm(x, [8], w, b, 1e-5)
    assert torch.equal(out, want[0]) and torch.equal(mean, want[1])
    grads = on_device(LN_BWD, cuda_backward, "cuda")(x, x, [8], mean, rstd, w, b, [True, True, True])
    assert seen == [(torch.float32, torch.float32)] and grads[0].dtype == torch.bfloat16
    cpu_bwd = on_device(LN_BWD, aten.native_layer_norm_backward.default, "cpu")  # float32 given, bf16 read
    assert torch.equal(cpu_bwd(x, x, [8], mean.float(), rstd.float(), w, b, [True] * 3)[0], grads[0])
    fn = aten.native_layer_norm.default
    assert on_device(LN, fn, "cuda") is fn and on_device(LN, fn, "meta", graph_dtypes) is fn
    assert on_device("aten.addmm.default", fn, "cuda", graph_dtypes) is fn
    assert {LN, LN_BWD} <= set(DEVICE_TYPED)


def test_profiling_a_cuda_typed_graph_on_the_cpu_measures_every_op() -> None:
    """Profiling calls ops without the graph (run_op): the layer norm backward still gets its statistics as the
    CPU's kernel reads them (bf16), so no op is left out of the CPU's costs."""
    from xsched.devices.base import Policy
    from xsched.profiling.measure import profile_graph

    m, x = block()
    graph = capture(m, (x,), device_type="cuda")
    quick = Policy().quick()
    profile = profile_graph(graph, ["cpu"], progress=False, policy=quick, rounds=1, copy_sizes=(1 << 10,))
    assert set(profile.compute["cpu"]) == {o.id for o in graph.ops} and not profile.extra.get("unsupported")


def test_ops_run_unwrapped_where_the_kernel_agrees_with_the_graph() -> None:
    """A CUDA-typed graph's layer norms run as they are on CUDA and wrapped on the CPU; a CPU-typed graph's the
    other way round; every other op is never wrapped."""
    m, x = block()
    for typed, other in (("cuda", "cpu"), ("cpu", "cuda")):
        graph = capture(m, (x,), device_type=typed)
        for op in graph.ops:
            fn = lambda *a: None  # noqa: E731
            table = op.target in DEVICE_TYPED
            assert agrees(graph, op, typed) and adapted(graph, op, fn, typed) is fn
            assert agrees(graph, op, other) is (not table) and (adapted(graph, op, fn, other) is fn) is (not table)


def test_plan_wrap_and_wrap_type_the_graph_alike() -> None:
    """Both take the type from the same devices (the train session's devices and stores; wrap's devices and
    stores): one GPU among them types for CUDA."""
    assert target_device_type(["cuda:0", "cpu"]) == target_device_type(["cpu", "cuda:0"]) == "cuda"
    assert target_device_type(["cpu:0", "cpu:1"]) == "cpu"


def test_train_bf16_with_a_cuda_typed_graph_on_logical_cpus(tmp_path, monkeypatch) -> None:
    """`xsched train --precision bf16 --param-home cpu:1` with both plan_wrap and wrap typing for CUDA (their
    device check patched: there is no GPU here): the plan is solved for the CUDA-typed graph, wrap captures the same
    graph and runs it (a mismatch would refuse the plan), and the losses equal the CPU-typed run's bit for bit."""
    from xsched.train import TrainConfig, train

    scale = "tiny:n_layer=2,dropout=0.0"  # no dropout: a CUDA-typed graph's is native_dropout, rounded otherwise
    config = TrainConfig(
        "zoo:gpt2",
        {"cpu:0": "100%", "cpu:1": "1GiB"},
        steps=2,
        scale=scale,
        precision="bf16",
        method="eager",
        profile="model",
        cache_dir=str(tmp_path / "cpu"),
        param_home="cpu:1",
        stores=("cpu:1",),
    )
    plain = train(config)
    for module in ("xsched.train.plan_wrap", "xsched.execute.wrap"):
        monkeypatch.setattr(importlib.import_module(module), "target_device_type", lambda devices: "cuda")
    typed = train(dataclasses.replace(config, cache_dir=str(tmp_path / "cuda")))
    z = zoo.build("gpt2", scale=scale)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # as train captures it: bf16 weights, its loss output 1
        graphs = {d: capture(z.model.to(BF16), z.inputs, device_type=d, grad_outputs=(1,)) for d in ("cpu", "cuda")}
    assert Plan.load(plain.plan_path).graph == graphs["cpu"].fingerprint
    assert Plan.load(typed.plan_path).graph == graphs["cuda"].fingerprint != graphs["cpu"].fingerprint
    assert typed.losses == plain.losses


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [BF16, FP16])
def test_on_a_gpu_the_table_is_the_kernels_and_both_typings_run(dtype) -> None:
    """On a GPU (not run in this CPU session): CUDA's kernel makes the statistics the rule says, its backward runs
    on them, and the block's CUDA-typed graph (as made) and CPU-typed graph (through the adapter: its rstd rounded
    to the input's dtype before the backward) both run on cuda:0 and match eager on the GPU within the
    half-precision tolerance (the CPU-typed one loses the rounding)."""
    aten = torch.ops.aten
    x, w = torch.randn(4, 8, device="cuda", dtype=dtype), torch.randn(8, device="cuda", dtype=dtype)
    for weight in (w, None):  # float32 weights beside a half input: the CPU's mixed types, not asked of CUDA here
        out, mean, rstd = aten.native_layer_norm(x, [8], weight, weight, 1e-5)
        param = None if weight is None else str(weight.dtype).removeprefix("torch.")
        made = str(mean.dtype).removeprefix("torch.")
        assert (
            made
            == str(rstd.dtype).removeprefix("torch.")
            == norm_stats("cuda", str(dtype).removeprefix("torch."), param)
        )
        aten.native_layer_norm_backward(
            out, x, [8], mean, rstd, weight, weight, [True, weight is not None, weight is not None]
        )
    m, xc = block(dtype)
    m, xc = m.cuda(), xc.cuda()
    out, grads = eager_run(m, xc)
    for device_type in ("cuda", "cpu"):
        graph = capture(m, (xc,), device_type=device_type)
        profile = Profile(
            graph.fingerprint, {"cuda:0": DeviceInfo("cuda")}, {"cuda:0": {o.id: OpCost(1e-3) for o in graph.ops}}, {}
        )
        plan = solve(graph, profile, {}, ("cuda:0",), "eager")
        got = unpack_outputs(graph, Executor(graph, plan)(bind_inputs(graph, m, (xc,))).outputs)
        torch.testing.assert_close(got.outputs[0], out, rtol=2e-2, atol=2e-2)
        for n, g in grads.items():
            torch.testing.assert_close(
                got.grads[n], g, rtol=2e-2, atol=2e-2, msg=lambda s, n=n, d=device_type: f"{d} {n}: {s}"
            )


BF16_LN = """
import torch
from torch import nn

def factory(batch=4):
    torch.manual_seed(0)
    return nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 4)).to(torch.bfloat16), torch.randn(batch, 16).bfloat16()
"""


def test_xsched_capture_types_for_the_device_asked(tmp_path) -> None:
    """`xsched capture --device-type cuda` writes the CUDA-typed graph; without it, the model's own (the CPU's)."""
    from xsched.cli import main

    (tmp_path / "m.py").write_text(BF16_LN)
    for flag, want in (([], "bfloat16"), (["--device-type", "cuda"], "float32")):
        out = tmp_path / f"g{len(flag)}.json"
        assert main(["capture", f"{tmp_path}/m.py:factory", *flag, "-o", str(out)]) == 0
        graph = Graph.load(out)
        assert [graph.value[v].dtype for v in stats(graph)] == [want, want]
