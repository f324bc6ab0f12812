"""The torch rows of the GPU memory benchmark (scripts/bench_gpu_memory.py): eager PyTorch, torch.utils.checkpoint
per block, save_on_cpu, torchtune's OffloadActivations and torch.compile (plain and with activation_memory_budget),
the step each row runs (every differentiable output backpropagated with ones, or with --loss-backward the loss alone)
and the interleaved timing every row of the benchmark shares."""

from __future__ import annotations

import contextlib
import functools
import gc
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from bench_cuda import _Backward, _tensor_leaves, one_line, sync
from bench_executor import step_memory
from gpu.memory_report import mib

SEED = 1234


# ---- the step: which outputs it backpropagates ----
def backpropagated(outs: list[torch.Tensor], loss_backward: bool) -> list[torch.Tensor]:
    """The forward's outputs a step backpropagates ones into: every differentiable one (what a graph captured with
    grad_outputs="all" computes), or with --loss-backward the loss alone, as `loss.backward()` does (zoo gpt2 returns
    (logits, loss): the last)."""
    return [outs[-1]] if loss_backward else [o for o in outs if o.requires_grad]


def ones_for(model: torch.nn.Module, inputs: tuple, loss_backward: bool) -> list[torch.Tensor]:
    """Ones shaped as each output the step backpropagates (one forward finds them; its grads are dropped)."""
    ones = [torch.ones_like(o) for o in backpropagated(_tensor_leaves(model(*inputs)), loss_backward)]
    model.zero_grad(set_to_none=True)
    return ones


def eager_grads(model: torch.nn.Module, inputs: tuple, loss_backward: bool) -> dict[str, torch.Tensor]:
    """The parameters' gradients of one eager step seeded as every timed step (the executor replays dropout's
    draws), on the host: the oracle each xsched row's gradients are held to."""
    ones = ones_for(model, inputs, loss_backward)
    model.zero_grad(set_to_none=True)
    torch.manual_seed(SEED)
    torch.autograd.backward(backpropagated(_tensor_leaves(model(*inputs)), loss_backward), ones)
    grads = {n: p.grad.detach().cpu() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def grad_outputs(loss_backward: bool) -> str:
    """capture's and wrap's grad_outputs for that step: "all", or "auto", which differentiates the forward's scalar
    outputs: GPT-2's loss alone (bench_gpu_plan_rows.captured checks it)."""
    return "auto" if loss_backward else "all"


def step_named(loss_backward: bool) -> str:
    """The step measured, in words (the table's title, the JSON's facts)."""
    if loss_backward:
        return "loss.backward(): the loss alone backpropagated, the logits returned and kept without a gradient"
    return "backward of every differentiable output (logits and loss) with ones"


# ---- torch rows: forward under a context, backward with ones outside it ----
def torch_step(
    model: torch.nn.Module, inputs: tuple, ones: list, context: Callable[[], Any], loss_backward: bool = False
) -> Callable[[], Any]:
    """One step: grads set to None, the forward under `context()`, returned as an object whose .backward() runs
    the backward of `backpropagated` outputs (so bench_executor.step_memory can replay it), which holds every
    output until then, as a caller holding the logits does, and whose .loss holds the loss."""

    def forward() -> _Backward:
        model.zero_grad(set_to_none=True)
        with context():
            outs = _tensor_leaves(model(*inputs))
        b = _Backward(backpropagated(outs, loss_backward), ones, keep=outs)
        b.loss = outs[-1].detach()  # type: ignore[attr-defined]  # zoo gpt2 returns (logits, loss)
        return b

    return forward


@contextlib.contextmanager
def checkpointed_blocks(model: torch.nn.Module) -> Iterator[None]:
    """torch.utils.checkpoint around every transformer block (model.h[i]) while the context is open."""
    from torch.utils.checkpoint import checkpoint

    for block in model.h:  # type: ignore[union-attr]
        block.forward = functools.partial(checkpoint, type(block).forward.__get__(block), use_reentrant=False)
    try:
        yield
    finally:
        for block in model.h:  # type: ignore[union-attr]
            del block.forward


def torchtune_offload() -> Callable[[], Any] | str:
    """torchtune's OffloadActivations as a context factory, or why not."""
    try:
        from torchtune.training import OffloadActivations
    except Exception as e:  # not installed, or its imports (torchao, datasets, ...) fail
        return f"skipped: torchtune does not import ({one_line(e)})"
    return OffloadActivations


def compile_rows(
    model: torch.nn.Module, inputs: tuple, dev: torch.device, eager: Callable[[], float], a, t_start: float
) -> list[dict]:
    """torch.compile, plain and with `torch._functorch.config.activation_memory_budget` at each xsched budget (as a
    fraction: torch's min-cut partitioner saves that share of the activations and recomputes the rest), each timed
    interleaved with eager PyTorch. Compiled one at a time (dynamo's cache does not key on the budget); a row is
    skipped when less than 1.5x the last compile's time is left before --deadline."""
    import torch._dynamo
    import torch._functorch.config as functorch_config

    ones = ones_for(model, inputs, a.loss_backward)
    rows: list[dict] = []
    took = 0.0
    for pct in [None, *a.budgets]:
        label = "torch.compile" if pct is None else f"torch.compile, activation_memory_budget {pct / 100:g}"
        left = a.deadline - (time.perf_counter() - t_start)
        if left < max(10.0 if dev.type == "cpu" else 45.0, 1.5 * took):  # inductor on GPT-2: tens of seconds
            rows.append({"plan": label, "error": f"skipped: {left:.0f} s left of --deadline"})
            continue
        t0 = time.perf_counter()
        try:
            torch._dynamo.reset()
            compiled = torch.compile(model, backend=a.compile_backend)
            step = torch_step(compiled, inputs, ones, contextlib.nullcontext, a.loss_backward)
            run = backward_of(step, model)
            with functorch_config.patch(activation_memory_budget=1.0 if pct is None else pct / 100):
                run()  # forward and backward compiled now; the partition (what is saved) is chosen here
            took = time.perf_counter() - t0
            got = timed({"row": run, "eager": eager}, dev, a.iters, a.warmup)
            peak = got["row"]["peak"] if dev.type == "cuda" else step_memory(step, model.parameters()).peak  # type: ignore[arg-type]
        except Exception as e:  # a backend that does not build here must not lose the other rows
            rows.append({"plan": label, "error": f"error: {one_line(e)}"})
            continue
        finally:
            model.zero_grad(set_to_none=True)
        row = {
            "plan": label,
            "time_s": statistics.median(got["row"]["times"]),
            "peak": peak,
            "loss": got["row"]["loss"],
        }
        row |= {"reserved": got["row"]["reserved"], "eager_s": statistics.median(got["eager"]["times"])}
        row |= {"eager_times": got["eager"]["times"], "compile_s": took, "budget": None if pct is None else pct / 100}
        rows.append(row)
        log(f"{label}: {row['time_s'] * 1e3:.1f} ms, step peak {mib(peak)} (compiled in {took:.0f} s)")
    torch._dynamo.reset()
    return rows


# ---- measuring ----
def timed(runs: dict[str, Callable[[], float]], dev: torch.device, iters: int, warmup: int) -> dict[str, dict]:
    """Per run name: wall seconds of `iters` steps after `warmup` untimed rounds, the runs interleaved (drift and
    load spread over all of them); on CUDA the step peak above the resident state in the first timed round
    (max_memory_allocated less memory_allocated before) and the reserved memory's growth (max_memory_reserved less
    memory_reserved before, the cache emptied first); the loss of the last step, every step seeded alike."""
    out: dict[str, dict] = {k: {"times": [], "peak": None, "reserved": None, "loss": None} for k in runs}
    for r in range(warmup + iters):
        for k, run in runs.items():
            first = r == warmup
            if first:
                gc.collect()
            sync(dev)
            if first and dev.type == "cuda":
                torch.cuda.empty_cache()  # the cached pool of earlier rows would hide this row's reserved growth
                base = torch.cuda.memory_allocated(dev)
                base_reserved = torch.cuda.memory_reserved(dev)
                torch.cuda.reset_peak_memory_stats(dev)
            torch.manual_seed(SEED)
            t0 = time.perf_counter()
            out[k]["loss"] = run()
            sync(dev)
            if r >= warmup:
                out[k]["times"].append(time.perf_counter() - t0)
            if first and dev.type == "cuda":
                out[k]["peak"] = torch.cuda.max_memory_allocated(dev) - base
                out[k]["reserved"] = torch.cuda.max_memory_reserved(dev) - base_reserved
    return out


def backward_of(step: Callable[[], _Backward], model: torch.nn.Module) -> Callable[[], float]:
    """A whole torch step; its grads are dropped after it, so the next run's resident state does not hold them."""

    def run() -> float:
        b = step()
        b.backward()
        model.zero_grad(set_to_none=True)
        return float(b.loss)  # type: ignore[attr-defined]

    return run


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def torch_rows(model: torch.nn.Module, inputs: tuple, dev: torch.device, a) -> tuple[list[dict], Callable, list]:
    """The torch rows, measured interleaved with each other; the eager step (as a whole) and its step times."""
    ones = ones_for(model, inputs, a.loss_backward)
    contexts: dict[str, Callable[[], Any] | str] = {
        "eager PyTorch": contextlib.nullcontext,
        "torch.utils.checkpoint per block": lambda: checkpointed_blocks(model),
        "save_on_cpu(pin_memory=True)": lambda: torch.autograd.graph.save_on_cpu(pin_memory=True),
        "torchtune OffloadActivations": torchtune_offload() if dev.type == "cuda" else "skipped: CUDA streams only",
    }
    live = {k: c for k, c in contexts.items() if not isinstance(c, str)}
    steps = {k: torch_step(model, inputs, ones, c, a.loss_backward) for k, c in live.items()}
    got = timed({k: backward_of(s, model) for k, s in steps.items()}, dev, a.iters, a.warmup)
    rows = []
    for k, c in contexts.items():
        if isinstance(c, str):
            rows.append({"plan": k, "error": c})
            continue
        peak = got[k]["peak"] if dev.type == "cuda" else step_memory(steps[k], model.parameters()).peak  # type: ignore[arg-type]
        model.zero_grad(set_to_none=True)
        row = {"plan": k, "time_s": statistics.median(got[k]["times"]), "peak": peak, "loss": got[k]["loss"]}
        rows.append({**row, "reserved": got[k]["reserved"]})
        log(f"{k}: {rows[-1]['time_s'] * 1e3:.1f} ms, step peak {mib(peak)}")
    return rows, backward_of(steps["eager PyTorch"], model), list(got["eager PyTorch"]["times"])
