"""Bound soundness against torch: every lower bound xsched.solve.bounds.memory reports is at or below the peak that
eager PyTorch and torch.utils.checkpoint per block reach for the same step, counted by the allocator-level
xsched.execute.live_bytes (a bound above what PyTorch does would be a "proven infeasible" that is not)."""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch
from torch.utils._pytree import tree_flatten
from torch.utils.checkpoint import checkpoint

from xsched import zoo
from xsched.capture.torch import capture
from xsched.execute.live_bytes import LiveBytes
from xsched.solve.bounds.memory import lower_bounds

pytestmark = pytest.mark.usefixtures("one_thread")


def differentiable(outputs) -> list[torch.Tensor]:
    return [o for o in tree_flatten(outputs)[0] if isinstance(o, torch.Tensor) and o.requires_grad]


def step_peak(model: torch.nn.Module, inputs: tuple, autocast, how: str) -> tuple[int, int]:
    """(bytes resident before the step, the most bytes live during it above them) of one step: forward, then the
    backward of every differentiable output with ones (what the captured graph computes: "ones"), or of the loss
    alone ("loss", as a training loop does; the logits get no gradient and no ones are made)."""
    ones = [torch.ones_like(o) for o in differentiable(model(*inputs))] if how != "loss" else []
    model.zero_grad(set_to_none=True)
    resident = sum(p.nbytes for p in model.parameters()) + sum(x.nbytes for x in inputs) + sum(o.nbytes for o in ones)
    count = LiveBytes()
    with count:
        with autocast():
            outs = differentiable(model(*inputs))
        if how == "loss":
            outs[-1].backward()
        else:
            torch.autograd.backward(outs, ones)
        del outs
    model.zero_grad(set_to_none=True)
    return resident, count.peak.get(count.device, 0)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_bounds_hold_for_eager_and_checkpointed_steps(dtype: str) -> None:
    """GPT-2 with a vocabulary large enough that the loss's backward (three logits-sized fp32 tensors, the op the
    H100 bf16 bound named) sets the bound, in fp32 and under CPU bf16 autocast."""
    torch.manual_seed(0)
    z = zoo.build("gpt2", batch=8, scale="small:n_layer=2,vocab=8192")
    model, inputs = z.model, z.inputs
    if dtype == "float32":
        autocast = contextlib.nullcontext
    else:
        autocast = functools.partial(torch.autocast, "cpu", dtype=torch.bfloat16)
    with autocast():
        graph = capture(model, inputs, name="gpt2")
    homes = {v: "cpu" for v in graph.inputs}
    bound = lower_bounds(graph, None, ["cpu"], homes)["cpu"]
    homed = sum(graph.value[v].nbytes for v in graph.inputs)
    assert bound.op is not None and "log_softmax_backward" in graph.op[bound.op].target  # the loss sets it
    for how in ("ones", "checkpoint", "loss"):
        if how == "checkpoint":
            for block in model.h:
                block.forward = functools.partial(checkpoint, type(block).forward.__get__(block), use_reentrant=False)
        try:
            resident, peak = step_peak(model, inputs, autocast, how)
        finally:
            for block in model.h:
                vars(block).pop("forward", None)
        # the graph's inputs are what a step holds before it starts (its ones included, where it has them)
        assert bound.bytes - homed <= peak, (how, bound.bytes - homed, peak)
        assert bound.bytes <= resident + peak, (how, bound.bytes, resident + peak)
