"""Ops with kernels on some device types only (contracts/device_kernels.py): the CPU's fused attention and its
backward, captured by every model calling F.scaled_dot_product_attention on the CPU, run elsewhere as
contracts/neutral_attention.py. Its outputs against the CPU kernel itself (values, shapes, dtypes, layouts) over
causal, masks, scales, L != S and grouped-query heads; its blocks' transient against the whole score matrix; a
captured attention model's plan run with the stand-in forced (the table patched so the CPU lacks the kernel)
against eager; the dropout refusal; and, on a GPU, a CPU-captured graph on cuda:0 against eager there."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from xsched.capture.torch import bind_inputs, capture, unpack_outputs
from xsched.contracts.device_dtypes import adapted, arg_names
from xsched.contracts.device_kernels import DEVICE_KERNELS, SDPA_CPU, SDPA_CPU_BACKWARD, has_kernel, kernel_for
from xsched.contracts.graph import Graph
from xsched.contracts.neutral_attention import attention_backward, attention_forward
from xsched.contracts.plan import Compute
from xsched.contracts.profile import DeviceInfo, LinkCost, OpCost, Profile
from xsched.errors import XschedError
from xsched.execute.executor import Executor
from xsched.execute.live_bytes import LiveBytes
from xsched.execute.reference import run_plan
from xsched.solve.api import solve

pytestmark = pytest.mark.usefixtures("one_thread")

aten = torch.ops.aten
FWD, BWD = (
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
)
FP32_TOL = {"rtol": 1e-5, "atol": 1e-5}
HALF_TOL = {"rtol": 3e-3, "atol": 3e-3}  # float16's ulp is 8x finer than bf16's
BF16_TOL = {"rtol": 2e-2, "atol": 2e-2}  # a few bf16 ulps: both round once to bf16, from float32 sums in two orders


def masked_rows(L: int, S: int) -> torch.Tensor:
    """An additive mask with one row fully masked and one masked from key 2 on."""
    m = torch.zeros(L, S)
    m[1] = float("-inf")
    m[3, 2:] = float("-inf")
    return m


# name: (B, H, Hk, L, S, E), causal, mask (None, or a function of (B, H, L, S)), scale, block_bytes, query transposed
CASES = {
    "plain": ((2, 4, 4, 5, 7, 8), False, None, None, 1 << 20, False),
    "tiled": ((2, 4, 4, 5, 7, 8), False, None, None, 64, False),
    "causal-L>S": ((2, 4, 2, 9, 7, 8), True, None, None, 100, False),
    "causal-L<S": ((2, 4, 2, 5, 12, 8), True, None, None, 300, False),
    "mask-batch-scale": ((2, 4, 4, 5, 7, 8), False, lambda B, H, L, S: torch.randn(B, 1, L, S), 0.3, 200, False),
    "mask-heads-causal": ((2, 4, 4, 5, 7, 8), True, lambda B, H, L, S: torch.randn(1, H, 1, S), None, 200, False),
    "mask-2d-mqa-transposed": ((2, 4, 1, 5, 7, 8), False, lambda B, H, L, S: torch.randn(L, S), None, 10, True),
    "mask-full-gqa": ((2, 6, 2, 6, 9, 8), False, lambda B, H, L, S: torch.randn(B, H, L, S), None, 150, True),
    "masked-rows": ((2, 4, 4, 5, 7, 8), False, lambda B, H, L, S: masked_rows(L, S), None, 200, False),
}


def attention_inputs(shape, dtype, transposed, seed=0):
    B, H, Hk, L, S, E = shape
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, L, H, E, generator=g).transpose(1, 2) if transposed else torch.randn(B, H, L, E, generator=g)
    k, v = torch.randn(B, Hk, S, E, generator=g), torch.randn(B, Hk, S, E, generator=g)
    return q.to(dtype), k.to(dtype), v.to(dtype), torch.randn(B, H, L, E, generator=g).to(dtype)


def assert_same(got, want, tol) -> None:
    """Values within `tol`; shapes, dtypes and strides exactly the kernel's."""
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert (a.shape, a.dtype, a.stride()) == (b.shape, b.dtype, b.stride()), i
        torch.testing.assert_close(a, b, **tol, msg=lambda s, i=i: f"output {i}: {s}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(CASES))
def test_the_stand_in_is_the_cpu_kernel(name, dtype) -> None:
    shape, causal, make_mask, scale, block_bytes, transposed = CASES[name]
    B, H, _, L, S, _ = shape
    q, k, v, grad = attention_inputs(shape, dtype, transposed)
    torch.manual_seed(1)  # the masks' draws
    mask = None if make_mask is None else make_mask(B, H, L, S).to(dtype)  # the kernel takes the query's dtype
    kw = {"attn_mask": mask, "scale": scale}
    out, lse = FWD(q, k, v, 0.0, causal, **kw)
    tol = {torch.float64: {"rtol": 1e-12, "atol": 1e-12}, torch.float32: FP32_TOL, torch.float16: HALF_TOL}.get(
        dtype, BF16_TOL
    )
    assert_same(attention_forward(q, k, v, 0.0, causal, **kw, block_bytes=block_bytes), (out, lse), tol)
    want = BWD(grad, q, k, v, out, lse, 0.0, causal, **kw)
    assert_same(attention_backward(grad, q, k, v, out, lse, 0.0, causal, **kw, block_bytes=block_bytes), want, tol)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float64])
@pytest.mark.parametrize("name", ["causal-L>S", "mask-full-gqa"])
def test_half_and_double_too(name, dtype) -> None:
    """float16 accumulates in float32 as bf16 does; float64 keeps float64 (its logsumexp too)."""
    test_the_stand_in_is_the_cpu_kernel(name, dtype)


def test_a_bool_mask_is_the_additive_mask_it_stands_for() -> None:
    """The fused kernel takes only additive masks (F.scaled_dot_product_attention converts a bool one, True
    attends); the stand-in takes both, alike."""
    q, k, v, grad = attention_inputs((2, 4, 2, 6, 6, 8), torch.float32, False)
    keep = torch.ones(6, 6, dtype=torch.bool).tril()
    additive = torch.zeros(6, 6).masked_fill(~keep, float("-inf"))
    out, lse = FWD(q, k, v, attn_mask=additive)
    assert_same(attention_forward(q, k, v, attn_mask=keep, block_bytes=256), (out, lse), FP32_TOL)
    want = BWD(grad, q, k, v, out, lse, 0.0, False, attn_mask=additive)
    assert_same(
        attention_backward(grad, q, k, v, out, lse, 0.0, False, attn_mask=keep, block_bytes=256), want, FP32_TOL
    )


def test_blocks_bound_the_transient() -> None:
    """B2 H4 L256 S64: the whole float32 score tensor is 16 blocks of 32 KiB; the forward's and the backward's
    live bytes beyond their inputs and results (LiveBytes, the executor's independent count) stay under 2.5
    blocks (one block of scores or two half blocks, beside the key-sized float32 copies, under one block), and
    the results are the kernel's."""
    shape, block = (2, 4, 4, 256, 64, 8), 32 << 10
    q, k, v, grad = attention_inputs(shape, torch.float32, True)
    out, lse = FWD(q, k, v, 0.0, True)
    for run in (
        lambda: attention_forward(q, k, v, 0.0, True, block_bytes=block),
        lambda: attention_backward(grad, q, k, v, out, lse, 0.0, True, block_bytes=block),
    ):
        with LiveBytes() as count:
            for t in (q, k, v, grad, out, lse):
                count.track(t)
            count.reset_peak()
            before = count.used["?"]
            results = run()
        transient = count.peak["?"] - before - sum(t.untyped_storage().nbytes() for t in results)
        assert block <= transient <= 2.5 * block
    assert_same(attention_forward(q, k, v, 0.0, True, block_bytes=block), (out, lse), FP32_TOL)


def test_the_table_names_cpu_kernels_and_the_hook_swaps_them_elsewhere() -> None:
    for target, entry in DEVICE_KERNELS.items():
        ns, name, overload = target.split(".")
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"{ns}::{name}", "CPU"), target
        assert entry.dropout is not None and arg_names(target).index(entry.dropout[0]) == entry.dropout[1]
        assert has_kernel(target, "cpu") and has_kernel(target, "meta") and not has_kernel(target, "cuda")
    fn = FWD
    assert kernel_for(SDPA_CPU, fn, "cpu") is fn and kernel_for(SDPA_CPU, fn, "cuda") is not fn
    assert kernel_for("aten.addmm.default", fn, "cuda") is fn and has_kernel("aten.addmm.default", "mps")
    q, k, v, _ = attention_inputs((1, 2, 2, 3, 3, 4), torch.float32, False)
    assert_same(kernel_for(SDPA_CPU, fn, "cuda")(q, k, v, 0.0, True), FWD(q, k, v, 0.0, True), FP32_TOL)


def with_dropout(graph: Graph, p: float) -> Graph:
    """`graph` with its attention forwards asking for dropout `p` (a CPU capture never records one: torch 2.13 takes
    the math path for dropout on the CPU, and this kernel refuses it; a graph file from elsewhere may)."""
    ops = []
    for o in graph.ops:
        if o.target == SDPA_CPU:
            args = list(o.call["args"]) + [0.0, False][len(o.call["args"]) - 3 :]
            o = dataclasses.replace(o, call={**o.call, "args": args[:3] + [p] + args[4:]})
        ops.append(o)
    return dataclasses.replace(graph, ops=tuple(ops))


def test_dropout_off_the_cpu_is_refused_in_one_line() -> None:
    op = next(o for o in with_dropout(attention_graph(), 0.1).ops if o.target == SDPA_CPU)
    q, k, v, _ = attention_inputs((1, 2, 2, 3, 3, 4), torch.float32, False)
    for call in (lambda f: f(q, k, v, 0.1), lambda f: f(q, k, v, dropout_p=0.1)):
        with pytest.raises(XschedError) as e:
            call(adapted(None, op, FWD, "cuda"))
        assert (e.value.stage, e.value.op, e.value.device) == ("execute", op.id, "cpu")
        assert "\n" not in str(e.value) and "dropout_p=0.1" in str(e.value)
        assert "capture the model on the device it runs on, or set its attention dropout to 0" in str(e.value)
    with pytest.raises(RuntimeError, match="do not support dropout"):  # the CPU kernel refuses it too
        adapted(None, op, FWD, "cpu")(q, k, v, 0.1)


# ---- a captured model, run with the stand-in ----
class Attention(nn.Module):
    """Two attentions as Hugging Face models call them: grouped-query heads under a padding mask, then causal with
    a scale; the query, key and value are transposed views of the projections."""

    def __init__(self, dim: int = 32, heads: int = 4, kv_heads: int = 2) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.q, self.o = nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.k, self.v = nn.Linear(dim, kv_heads * self.head_dim), nn.Linear(dim, kv_heads * self.head_dim)

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q(x).view(B, T, self.heads, self.head_dim).transpose(1, 2)
        k = self.k(x).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v(x).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, enable_gqa=True)
        b = F.scaled_dot_product_attention(a, a, a, is_causal=True, scale=0.2)
        return self.o(b.transpose(1, 2).reshape(B, T, -1))


def attention_model() -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    keep = torch.ones(2, 1, 6, 6, dtype=torch.bool)
    keep[1, :, :, 4:] = False  # the second sequence padded after 4 tokens
    return Attention(), (torch.randn(2, 6, 32), keep)


def attention_graph() -> Graph:
    return capture(*attention_model())


def unit_profile(graph: Graph, devices: tuple[str, ...], kind: str = "cpu") -> Profile:
    links = {f"{a}->{b}": LinkCost(1e-4, 1e9) for a in devices for b in devices if a != b}
    compute = {d: {o.id: OpCost(1e-3) for o in graph.ops} for d in devices}
    return Profile(graph.fingerprint, {d: DeviceInfo(kind) for d in devices}, compute, links)


def eager_run(m: nn.Module, inputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    m = copy.deepcopy(m)
    out = m(*inputs)
    out.backward(torch.ones_like(out))
    return out.detach(), {n: p.grad for n, p in m.named_parameters()}


@pytest.fixture
def no_cpu_kernel(monkeypatch) -> list[str]:
    """The table patched so that the CPU lacks the attention kernels: every path runs the stand-in on the CPU.
    Returns the targets the stand-ins ran, one entry a call."""
    ran: list[str] = []
    for target, entry in list(DEVICE_KERNELS.items()):

        def counted(*args, _fn=entry.neutral, _target=target, **kwargs):
            ran.append(_target)
            return _fn(*args, **kwargs)

        monkeypatch.setitem(DEVICE_KERNELS, target, dataclasses.replace(entry, device_types=("meta",), neutral=counted))
    return ran


ATTENTION = (SDPA_CPU, SDPA_CPU_BACKWARD)


def split_profile(graph: Graph) -> Profile:
    """cpu:1 fast at attention and slow at the rest, cpu:0 the other way round: the fastest plan moves values."""
    profile = unit_profile(graph, ("cpu:0", "cpu:1"))
    compute = {
        d: {o.id: OpCost(1e-4 if (o.target in ATTENTION) == (d == "cpu:1") else 1.0) for o in graph.ops}
        for d in ("cpu:0", "cpu:1")
    }
    return dataclasses.replace(profile, compute=compute)


@pytest.mark.parametrize("how", ["reference", "executor", "arena", "overlap", "compiled"])
def test_a_cpu_captured_plan_runs_on_the_stand_in_as_eager(no_cpu_kernel, how) -> None:
    """Through the reference interpreter, the executor's kernels, its planned addresses (no out= overload: the
    attention ops run outside the arena), its lanes' programs (attention on cpu:1, the rest on cpu:0) and inductor
    regions (which trace the stand-in): outputs and gradients equal eager's."""
    m, inputs = attention_model()
    graph = capture(m, inputs)
    targets = [o.target for o in graph.ops]
    assert targets.count(SDPA_CPU) == 2 and targets.count(SDPA_CPU_BACKWARD) == 2
    if how == "overlap":
        plan = solve(graph, split_profile(graph), {}, ("cpu:0", "cpu:1"), "fastest")
        where = {graph.op[s.op].target: s.device for s in plan.steps if isinstance(s, Compute)}
        assert where[SDPA_CPU] == where[SDPA_CPU_BACKWARD] == "cpu:1" and where["aten.addmm.default"] == "cpu:0"
    else:
        plan = solve(graph, unit_profile(graph, ("cpu:0",)), {}, ("cpu:0",), "eager")
    env = bind_inputs(graph, m, inputs)
    if how == "reference":
        values = run_plan(graph, plan, env)
    else:
        modes = {"overlap": how == "overlap", "compile": how == "compiled", "planned_addresses": how == "arena"}
        values = Executor(graph, plan, **modes)(env).outputs
    got, (out, grads) = unpack_outputs(graph, values), eager_run(m, inputs)
    assert set(no_cpu_kernel) == set(ATTENTION)  # the stand-ins ran (inductor calls them as it traces)
    torch.testing.assert_close(got.outputs[0], out, **FP32_TOL)
    assert got.grads.keys() == grads.keys()
    for n, g in grads.items():
        torch.testing.assert_close(got.grads[n], g, **FP32_TOL, msg=lambda s, n=n: f"{n}: {s}")


def test_profiling_without_the_kernel_measures_the_stand_in_and_refuses_dropout(no_cpu_kernel) -> None:
    """Every op is measured where the stand-in runs; with dropout the attention forward is left out with the
    refusal as its reason, and the pipeline's check says so in one line before any solver runs."""
    from xsched.devices.base import Policy
    from xsched.profiling.measure import check_runnable, profile_graph

    quick = {"progress": False, "policy": Policy().quick(), "rounds": 1, "copy_sizes": (1 << 10,)}
    graph = attention_graph()
    profile = profile_graph(graph, ["cpu"], **quick)
    assert set(profile.compute["cpu"]) == {o.id for o in graph.ops} and not profile.extra.get("unsupported")
    assert SDPA_CPU in no_cpu_kernel and SDPA_CPU_BACKWARD in no_cpu_kernel
    dropped = with_dropout(graph, 0.1)
    profile = profile_graph(dropped, ["cpu"], **quick)
    refused = [o for o in dropped.ops if o.id in profile.extra.get("unsupported", {}).get("cpu", {})]
    assert [o.target for o in refused] == [SDPA_CPU, SDPA_CPU]
    with pytest.raises(XschedError, match=r"cannot run on any of cpu: .*dropout_p=0.1 has no kernel") as e:
        check_runnable(dropped, profile, ["cpu"])
    assert "\n" not in str(e.value)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_on_a_gpu_a_cpu_captured_graph_runs_on_cuda_as_eager(dtype) -> None:
    """A graph captured on the CPU (the CPU's attention ops) planned on cuda:0 and run there: outputs and
    gradients within tolerance of the model's eager run on the GPU (CUDA's own fused attention); profiling on
    cuda:0 measures every op and records the stand-in's transient as workspace."""
    from xsched.devices.base import Policy
    from xsched.profiling.measure import profile_graph

    m, inputs = attention_model()
    m = m.to(dtype)
    x, keep = inputs[0].to(dtype), inputs[1]
    graph = capture(m, (x, keep))
    assert SDPA_CPU in {o.target for o in graph.ops}
    gm, ginputs = m.cuda(), (x.cuda(), keep.cuda())
    plan = solve(graph, unit_profile(graph, ("cuda:0",), "cuda"), {}, ("cuda:0",), "eager")
    got = unpack_outputs(graph, Executor(graph, plan)(bind_inputs(graph, gm, ginputs)).outputs)
    out, grads = eager_run(gm, ginputs)
    tol = FP32_TOL if dtype == torch.float32 else BF16_TOL
    tol = {"rtol": max(tol["rtol"], 1e-4), "atol": max(tol["atol"], 1e-4)}  # TF32-free, but another kernel's order
    torch.testing.assert_close(got.outputs[0], out, **tol)
    for n, g in grads.items():
        torch.testing.assert_close(got.grads[n], g, **tol, msg=lambda s, n=n: f"{n}: {s}")
    profile = profile_graph(graph, ["cuda:0"], progress=False, policy=Policy().quick(), rounds=1, copy_sizes=(1 << 10,))
    assert set(profile.compute["cuda:0"]) == {o.id for o in graph.ops}
    assert all(profile.compute["cuda:0"][o.id].workspace_bytes > 0 for o in graph.ops if o.target in ATTENTION)


def test_a_hugging_face_llama_trains_on_the_stand_in_as_eager(no_cpu_kernel) -> None:
    """The tiny grouped-query Llama (2 heads, 1 key/value head, SDPA) wrapped on the CPU with the CPU's kernel
    taken away: one step's loss and gradients equal eager PyTorch's (which runs the CPU kernel)."""
    pytest.importorskip("transformers")
    from hf_models import batches, build

    from xsched import wrap

    torch.manual_seed(0)
    model = build("llama", "sdpa")
    ref = copy.deepcopy(model)
    batch = batches("llama")(0)
    loss = wrap(model, batch, {"cpu": "100%"}, method="eager", profile="model")(*batch)
    loss.backward()
    want = ref(*batch)
    want.backward()
    assert SDPA_CPU in no_cpu_kernel and SDPA_CPU_BACKWARD in no_cpu_kernel
    torch.testing.assert_close(loss.detach(), want.detach(), rtol=1e-5, atol=1e-6)
    got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert got.keys() == {n for n, p in ref.named_parameters() if p.grad is not None}
    for n, p in ref.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(got[n], p.grad, rtol=1e-4, atol=1e-6, msg=lambda s, n=n: f"{n}: {s}")


def test_the_benchmark_script_runs_at_a_tiny_size() -> None:
    """scripts/bench_device_kernels.py: a row per phase and implementation, the stand-in's results the kernel's."""
    import subprocess
    import sys

    from train_support import ROOT, child_env

    cmd = [sys.executable, str(ROOT / "scripts" / "bench_device_kernels.py"), "--batch", "1", "--heads", "2"]
    cmd += ["--tokens", "32", "--head-dim", "8", "--reps", "1"]
    p = subprocess.run(cmd, capture_output=True, text=True, env=child_env(), timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = [
        line.strip("| ").split(" | ")
        for line in p.stdout.splitlines()
        if line.startswith("| f") or line.startswith("| b")
    ]
    assert [r[:2] for r in rows] == [[ph, impl] for ph in ("forward", "backward") for impl in ("kernel", "stand-in")]
    assert all(float(r[-1]) < 1e-5 for r in rows) and [r[6] == "-" for r in rows] == [True, False] * 2
