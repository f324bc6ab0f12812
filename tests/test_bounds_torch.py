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
from xsched.capture.torch import bind_inputs, capture
from xsched.execute.live_bytes import LiveBytes, measured_peaks
from xsched.execute.wrap_graph import held_by_caller
from xsched.pipeline import solve_plan
from xsched.solve.bounds import memory as memory_bounds
from xsched.solve.bounds.memory import lower_bounds
from xsched.train.optim import autocast as xsched_autocast

pytestmark = pytest.mark.usefixtures("one_thread")


def differentiable(outputs) -> list[torch.Tensor]:
    return [o for o in tree_flatten(outputs)[0] if isinstance(o, torch.Tensor) and o.requires_grad]


def step_peak(model: torch.nn.Module, inputs: tuple, autocast, how: str) -> tuple[int, int]:
    """(bytes resident before the step, the most bytes live during it above them) of one step: forward, then the
    backward of every differentiable output with ones (what the captured graph computes: "ones"), or of the loss
    alone ("loss": the logits get no gradient and no ones are made; "loss-only": the logits are also dropped
    before the backward, as a training loop that keeps only the loss does)."""
    ones = [torch.ones_like(o) for o in differentiable(model(*inputs))] if not how.startswith("loss") else []
    model.zero_grad(set_to_none=True)
    resident = sum(p.nbytes for p in model.parameters()) + sum(x.nbytes for x in inputs) + sum(o.nbytes for o in ones)
    count = LiveBytes()
    with count:
        with autocast():
            outs = differentiable(model(*inputs))
        if how == "loss-only":
            outs = outs[-1:]
        if how.startswith("loss"):
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


def checkpointed(model: torch.nn.Module) -> contextlib.AbstractContextManager:
    """torch.utils.checkpoint around every block of the zoo GPT-2, while the context is active."""

    @contextlib.contextmanager
    def blocks():
        for block in model.h:
            block.forward = functools.partial(checkpoint, type(block).forward.__get__(block), use_reentrant=False)
        try:
            yield
        finally:
            for block in model.h:
                vars(block).pop("forward", None)

    return blocks()


@pytest.fixture(scope="module")
def gpt2_full_vocab():
    """GPT-2 with the real vocabulary (50257) and little else, so the logits dominate the step as they do at 124M
    parameters, T1024, batch 8; and its graph captured in bf16 for the CPU and for a GPU (CUDA's autocast rules)."""
    torch.manual_seed(0)
    z = zoo.build("gpt2", batch=4, scale="small:n_layer=2,vocab=50257,dropout=0.0")
    graphs = {}
    for kinds in ((), ("cuda",)):
        with xsched_autocast("bf16", kinds):
            graphs[kinds or ("cpu",)] = capture(z.model, z.inputs, name="gpt2")
    with xsched_autocast("bf16", ("cuda",)):  # the loss's backward alone, as `xsched train` captures it
        graphs["loss"] = capture(z.model, z.inputs, name="gpt2", grad_outputs="auto")
    return z.model, z.inputs, graphs


def test_a_graph_for_the_gpu_holds_what_the_gpus_eager_step_holds(gpt2_full_vocab) -> None:
    """The bf16 case of issue 31: CPU autocast casts cross_entropy's input to fp32 (its backward holds three fp32
    logits), CUDA autocast does not (log_softmax in bf16, only nll_loss's input in fp32). Captured for a GPU, the graph
    follows CUDA's rules, and its bound is below every step eager PyTorch runs under them, the loss-only training
    step with the logits dropped and checkpoint per block included (allocator-counted)."""
    model, inputs, graphs = gpt2_full_vocab
    g = graphs[("cuda",)]
    lsm = [o for o in g.ops if o.target == "aten._log_softmax.default"]
    assert lsm and all(g.value[o.outputs[0]].dtype == "bfloat16" for o in lsm)
    gpu, cpu = (lower_bounds(x, None, ["cpu"], {v: "cpu" for v in x.inputs})["cpu"] for x in (g, graphs[("cpu",)]))
    assert "nll_loss_backward" in g.op[gpu.op].target and "log_softmax_backward" in graphs[("cpu",)].op[cpu.op].target
    fp32_logits = 4 * 64 * 50257 * 4
    assert gpu.bytes <= cpu.bytes - fp32_logits // 2  # a bf16 tensor in place of an fp32 one at the loss's backward
    amp = functools.partial(xsched_autocast, "bf16", ("cuda",))
    homed = sum(g.value[v].nbytes for v in g.inputs)
    for how in ("ones", "loss", "loss-only"):
        for ckpt in (False, True):
            with checkpointed(model) if ckpt else contextlib.nullcontext():
                resident, peak = step_peak(model, inputs, amp, how)
            assert gpu.bytes - homed <= peak, (how, ckpt, gpu.bytes - homed, peak)
            assert gpu.bytes <= resident + peak, (how, ckpt, gpu.bytes, resident + peak)


def test_a_plan_runs_below_the_bound_the_cpu_rules_set(gpt2_full_vocab) -> None:
    """The graph captured for a GPU has a plan (checkpointing, found by its solver) that runs, allocator-counted,
    within a budget below the bound of the same model captured by CPU autocast's rules, which xsched used to state
    for a GPU run as a proof of infeasibility."""
    model, inputs, graphs = gpt2_full_vocab
    g = graphs[("cuda",)]
    old = lower_bounds(graphs[("cpu",)], None, ["cpu"], {v: "cpu" for v in graphs[("cpu",)].inputs})["cpu"]
    budget = old.bytes * 95 // 100
    plan = solve_plan(g, {"cpu": budget}, method="checkpoint")
    homed = sum(g.value[v].nbytes for v in g.inputs)
    assert homed + measured_peaks(g, plan, bind_inputs(g, model, inputs))["cpu"] <= budget


def test_the_loss_only_graph_is_bounded_by_and_planned_within_the_loss_only_steps(gpt2_full_vocab) -> None:
    """Captured for `loss.backward()` (no gradient input for the logits, no backward through it), the graph's bound
    is below eager's and checkpoint's loss-only steps with the logits dropped, allocator-counted, and a checkpoint
    plan runs within torch checkpoint's measured peak."""
    model, inputs, graphs = gpt2_full_vocab
    g, every = graphs["loss"], graphs[("cuda",)]
    bound, old = (lower_bounds(x, None, ["cpu"], {v: "cpu" for v in x.inputs})["cpu"] for x in (g, every))
    bf16_logits = 4 * 64 * 50257 * 2
    assert bound.bytes <= old.bytes - bf16_logits  # the logits' tangent is gone from the homed inputs
    amp = functools.partial(xsched_autocast, "bf16", ("cuda",))
    homed = sum(g.value[v].nbytes for v in g.inputs)
    steps = {}
    for ckpt in (False, True):
        with checkpointed(model) if ckpt else contextlib.nullcontext():
            resident, peak = step_peak(model, inputs, amp, "loss-only")
        assert bound.bytes - homed <= peak and bound.bytes <= resident + peak, (ckpt, bound.bytes, resident + peak)
        steps[ckpt] = resident + peak
    plan = solve_plan(g, {"cpu": steps[True]}, method="checkpoint")
    assert homed + measured_peaks(g, plan, bind_inputs(g, model, inputs))["cpu"] <= steps[True]


def test_the_bound_with_the_logits_held_holds_for_eager_holding_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """GPT-2's logits come from a matmul, so a plan may release them during backward and make them again in the
    caller's storage (`contracts.holds`): the bound with the hold is the one without. Were they pinned (made by an
    op without an `out=` form), the bound is the loss's backward beside them: higher, and still at or below eager's
    allocator-counted step, which holds its outputs until backward is done."""
    torch.manual_seed(0)
    z = zoo.build("gpt2", batch=4, scale="small:n_layer=1,vocab=8192")
    graph = capture(z.model, z.inputs, name="gpt2")
    homes = {v: "cpu" for v in graph.inputs}
    free, released = (lower_bounds(g, None, ["cpu"], homes)["cpu"] for g in (graph, held_by_caller(graph)))
    assert released == free
    monkeypatch.setattr(memory_bounds, "pinned_holds", lambda g: g.held_outputs)
    held = lower_bounds(held_by_caller(graph), None, ["cpu"], homes)["cpu"]
    assert held.by == "held" and held.bytes > free.bytes, (held, free)
    resident, peak = step_peak(z.model, z.inputs, contextlib.nullcontext, "ones")
    homed = sum(graph.value[v].nbytes for v in graph.inputs)
    assert held.bytes - homed <= peak and held.bytes <= resident + peak, (held.bytes - homed, peak)
