"""The attention stand-in's transient, as a simulated GPU prices it: `transient_bytes` bounds what the stand-in
allocates (xsched's LiveBytes count of its storages, the oracle) within 1.7x, and a simulated GPU profiles the
CPU-captured attention ops with that bound as workspace, a simulated CPU (which runs the real kernel) with none."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from xsched.capture.torch import capture
from xsched.contracts.device_kernels import SDPA_CPU, SDPA_CPU_BACKWARD
from xsched.contracts.neutral_attention import attention_backward, attention_forward, transient_bytes
from xsched.devices import get_device
from xsched.execute.live_bytes import LiveBytes

CASES = [  # query (B, H, L, E), key (B, Hk, S, E), causal, mask
    ((2, 4, 64, 16), (2, 4, 64, 16), True, None),
    ((2, 8, 40, 16), (2, 2, 56, 16), False, "bool"),
    ((1, 4, 300, 32), (1, 4, 300, 32), False, "float"),
    ((2, 4, 128, 8), (2, 4, 128, 8), True, None),
]


def _laid_out(shape: tuple[int, ...], dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    B, H, L, E = shape  # as capture sees them: (B, L, H, E) buffers transposed
    return torch.randn(B, L, H, E, dtype=dtype, generator=g).transpose(1, 2)


def _counted(fn, inputs: tuple, outputs_of) -> int:
    """Bytes `fn(*inputs)` allocated at its peak beyond its inputs and what it returns (LiveBytes)."""
    with LiveBytes() as count:
        count.device = "x"
        for t in inputs:
            if isinstance(t, torch.Tensor):
                count.track(t)
        base = count.used.get("x", 0)
        count.peak["x"] = base
        got = fn(*inputs)
    return count.peak["x"] - base - sum(t.untyped_storage().nbytes() for t in outputs_of(got))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("qs, ks, causal, mask", CASES)
def test_the_bound_holds_what_the_stand_in_allocates(qs, ks, causal, mask, dtype) -> None:
    g = torch.Generator().manual_seed(5)
    q, k = _laid_out(qs, dtype, g), _laid_out(ks, dtype, g)
    v = _laid_out(ks, dtype, g)
    m = None
    if mask == "bool":
        m = torch.rand(qs[2], ks[2], generator=g) > 0.3
    elif mask == "float":
        m = torch.randn(qs[2], ks[2], generator=g).to(dtype)
    forward = _counted(lambda *a: attention_forward(*a, 0.0, causal, attn_mask=m), (q, k, v), lambda r: r)
    out, lse = attention_forward(q, k, v, 0.0, causal, attn_mask=m)
    go = torch.randn(out.shape, generator=g).to(dtype)
    backward = _counted(
        lambda *a: attention_backward(*a, 0.0, causal, attn_mask=m), (go, q, k, v, out, lse), lambda r: r
    )
    for counted, bound in (
        (forward, transient_bytes(qs, ks, dtype, backward=False)),
        (backward, transient_bytes(qs, ks, dtype, backward=True)),
    ):
        assert counted <= bound <= 1.7 * counted, (counted, bound)


def test_at_gpt2_small_size_the_bound_is_within_30_percent_of_the_count() -> None:
    """B8 H12 T1024 E64, causal, fp32 (the whole score tensor: 384 MiB; the stand-in holds under three 64 MiB
    blocks)."""
    g = torch.Generator().manual_seed(3)
    shape = (8, 12, 1024, 64)
    q, k, v = (_laid_out(shape, torch.float32, g) for _ in range(3))
    forward = _counted(lambda *a: attention_forward(*a, 0.0, True), (q, k, v), lambda r: r)
    bound = transient_bytes(shape, shape, torch.float32, backward=False)
    assert forward <= bound <= 1.3 * forward < 3 * (64 << 20)


class _Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(64, 192)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = (t.view(B, T, 4, 16).transpose(1, 2) for t in self.qkv(x).split(64, dim=2))
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).sum()


def test_a_simulated_gpu_prices_the_stand_ins_transient_and_a_simulated_cpu_none() -> None:
    torch.manual_seed(0)
    graph = capture(_Attention(), (torch.randn(2, 96, 64),))
    ops = {op.target: op for op in graph.ops if op.target in (SDPA_CPU, SDPA_CPU_BACKWARD)}
    assert set(ops) == {SDPA_CPU, SDPA_CPU_BACKWARD}
    gpu, cpu = get_device("sim:h100"), get_device("sim:xeon-8480")
    for target, op in ops.items():
        backward = target == SDPA_CPU_BACKWARD
        bound = transient_bytes((2, 4, 96, 16), (2, 4, 96, 16), torch.float32, backward=backward)
        assert gpu.measure_op(graph, op).workspace_bytes == bound > 0
        assert cpu.measure_op(graph, op).workspace_bytes == 0
    other = next(op for op in graph.ops if op.target not in ops)
    assert gpu.measure_op(graph, other).workspace_bytes == other.workspace_bytes


def test_the_fallback_prices_it_on_a_gpu_and_not_on_a_cpu() -> None:
    """Ops a capped profile skipped are priced by the roofline fallback, the stand-in's workspace included."""
    from xsched.contracts.profile import OpCost
    from xsched.profiling.fallback import roofline_costs

    torch.manual_seed(0)
    graph = capture(_Attention(), (torch.randn(2, 96, 64),))
    ops = [op for op in graph.ops if op.target in (SDPA_CPU, SDPA_CPU_BACKWARD)]
    bounds = {
        op.id: transient_bytes((2, 4, 96, 16), (2, 4, 96, 16), torch.float32, backward=op.target == SDPA_CPU_BACKWARD)
        for op in ops
    }
    measured = {o.id: OpCost(1e-5) for o in graph.ops if o.id not in bounds}
    skipped = roofline_costs(graph, get_device("sim:h100"), measured, list(bounds))
    assert {o: c.workspace_bytes for o, c in skipped.items()} == bounds
    on_cpu = roofline_costs(graph, get_device("cpu:0"), measured, list(bounds))
    assert all(c.workspace_bytes == 0 for c in on_cpu.values())
