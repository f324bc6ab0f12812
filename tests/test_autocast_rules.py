"""xsched.capture.autocast_rules: CPU autocast with CUDA's rules where the CPU has rules CUDA lacks, and back."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from xsched.capture.autocast_rules import KEEP, cpu_only_rules, device_rules


class _Dtypes(TorchDispatchMode):
    """The dtype of every aten op's output, by op name."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: dict[str, torch.dtype] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor):
            self.seen[str(func)] = out.dtype
        return out


def log_softmax_dtype() -> torch.dtype:
    """The dtype cross_entropy's log_softmax runs in, on bf16 logits under CPU bf16 autocast."""
    x, t = torch.randn(4, 10, dtype=torch.bfloat16, requires_grad=True), torch.tensor([1, 2, 3, 4])
    with torch.autocast("cpu", dtype=torch.bfloat16), _Dtypes() as seen:
        F.cross_entropy(x, t)
    return seen.seen["aten._log_softmax.default"]


def test_cuda_rules_nest_and_the_cpu_rules_come_back() -> None:
    assert log_softmax_dtype() == torch.float32  # the CPU's rule: cross_entropy_loss in fp32
    with device_rules("cuda"):
        assert log_softmax_dtype() == torch.bfloat16  # CUDA has none: log_softmax keeps the logits' dtype
        with device_rules("cuda"):
            assert log_softmax_dtype() == torch.bfloat16
        assert log_softmax_dtype() == torch.bfloat16  # the inner exit keeps the outer's rules
    assert log_softmax_dtype() == torch.float32
    with device_rules("cpu"):
        assert log_softmax_dtype() == torch.float32


def test_the_dropped_rules_are_the_cpus_that_cuda_lacks() -> None:
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    ops = cpu_only_rules("cuda")
    assert "cross_entropy_loss" in ops and not KEEP & set(ops)
    assert all(has(f"aten::{op}", "AutocastCPU") and not has(f"aten::{op}", "AutocastCUDA") for op in ops)
    assert cpu_only_rules("cpu") == ()
