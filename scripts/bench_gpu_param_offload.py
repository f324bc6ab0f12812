"""Training what does not fit one GPU (issues 25 and 30): GPT-2 1.56B whose parameters, gradients and AdamW states
exceed the GPU budget, trained by plain PyTorch on the GPU with no budget (the reference), by xsched (`xsched train
--param-home cpu --store cpu`: all three on the host, AdamW there overlapped with the run; fp32 exactly, and bf16
with fp32 master weights, the delayed update and the optimizer split), by FSDP2 with CPUOffloadPolicy, by DeepSpeed
ZeRO-Offload and torchao's CPUOffloadOptimizer where they import, and xsched alone on a 3.2B Llama in bf16.

python scripts/bench_gpu_param_offload.py --deadline 470 --json param_offload.json --out param_offload.md  # H100
python scripts/bench_gpu_param_offload.py --cpu --steps 3                  # reduced: cpu:0 computes, cpu:1 stores
python scripts/bench_gpu_param_offload.py --rows xsched --budget 8GiB --json po8.json --trace traces  # issue 30
python scripts/bench_gpu_param_offload.py --rows llama --llama-split 0.2   # a fixed split share (default: auto)
python scripts/bench_gpu_param_offload.py --rows xsched --switch-interval 0.0005  # the GIL's hand-off, every row

Each row runs in a process of its own (scripts/bench_rows_runner.py; its peak RSS is the row's host memory, its GPU
memory its own); the GPT-2 rows train the same initial weights on the same batches with the same AdamW (lr 1e-3,
weight decay 0.01 on 2+-D weights), and every loss is compared with the reference's. xsched rows add the per-step
breakdown (medians over the steps after the warm-up): compute, copies in and out (GPU time), the compute lane's idle
time, the host time spent issuing the GPU work and, per lane kind (compute, copies in, copies out), the lane
thread's own CPU inside its tasks beside their wall (`compute lane CPU / wall`: the rest is waiting, for the GIL,
a lock or a blocking CUDA call), the optimizer's time and the waits for it, and beside them what the
plan predicts per step (scripts/plan_traffic.py), the setup's stages, and the CUDA allocators' counts (retries,
cudaMalloc and cudaHostAlloc calls); `--trace` keeps each xsched row's last step as a Chrome trace with its plan
(each task's host and GPU spans, named by its plan steps). `--deadline` shortens the row limits (and skips rows)
so the whole run ends within it, keeping `reserve_s` for a late row (the Llama's); `--json` is rewritten after
every row.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from bench_param_offload_rows import (
    row_llama,
    row_reference_bf16,
    row_xsched,
    row_xsched_allcores,
    row_xsched_fast,
    row_xsched_one,
    table,
)
from bench_rows_runner import publish, run_child, run_rows

from xsched.cli.train import split_share

ROWS = (
    "reference",
    "xsched",
    "xsched_allcores",
    "xsched_one",
    "fsdp2",
    "reference_bf16",
    "xsched_fast",
    "llama",
    "deepspeed",
    "torchao",
)
LR, WEIGHT_DECAY = 1e-3, 0.01
GPU = {  # GPT-2 XL's shape (1.56B parameters: 5.8 GiB, 23 GiB with gradients and AdamW's two states)
    "scale": "full:n_layer=48,n_head=25,n_embd=1600,seq=512,batch=2,dropout=0.0",
    "device": "cuda:0",
    "budget": "16GiB",
    "store": "cpu",
    "host_budget": "100GiB",
    "method": "park",  # weights fetched ahead of their readers, parked again between reads
    "split": "auto",  # the fast row's --optimizer-split: the planner chooses the share (--split SHARE: a fixed one)
    "llama_scale": "full:seq=1024,batch=4",  # Llama 3.2 3B's shape, 4096 tokens a step
    "llama_budget": "70GiB",
    "llama_split": "auto",  # --optimizer-split auto (2026-11-27's run: 0.2, host AdamW bound; --llama-split 0.2)
    # seconds kept for a row from the rows before it under --deadline: the 3.2B model's build on the host, capture,
    # plan and steps (its setup alone measured about 25 s of one CPU without the build: BENCHMARKS §17)
    "reserve_s": {"llama": 180.0},
}
CPU = {  # the reduced mode: GPT-2 small, 8 layers; cpu:0 at the lowest budget today's solvers plan
    "scale": "small:n_layer=8,dropout=0.0",
    "device": "cpu:0",
    "budget": "3MiB",
    "store": "cpu:1",
    "host_budget": "1GiB",
    "method": "offload",  # 1 s to plan; park reaches 1.4 MiB, below the 1.6 MiB of parameters, in 16 s
    "split": "auto",
    "llama_scale": "tiny",
    "llama_budget": "2MiB",
    "llama_split": "auto",
}


# ---- the rows (each in a child process) ----
def task_of(setup: dict[str, Any]) -> Any:
    """The training task every row trains: the zoo's GPT-2 and its synthetic stream, seeded as `xsched train`."""
    from xsched.loaders import load_training_task

    torch.manual_seed(0)
    return load_training_task("zoo:gpt2", None, setup["scale"], 0)


def groups(params: Any) -> list[dict[str, Any]]:
    from xsched.train.optim import param_groups

    return param_groups(params, WEIGHT_DECAY)


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def backward_with(opt: torch.optim.Optimizer) -> Callable[[torch.Tensor], None]:
    """The plain backward: the optimizer's gradients set to None, then the loss's backward."""

    def backward(loss: torch.Tensor) -> None:
        opt.zero_grad(set_to_none=True)
        loss.backward()

    return backward


def train_loop(
    setup: dict[str, Any], task: Any, dev: torch.device, forward: Callable, backward: Callable, step: Callable
) -> dict[str, Any]:
    """`steps` steps of forward (inputs -> loss), backward (loss) and the optimizer step: losses, step times, the
    optimizer step's times and the GPU peak (over the steps, setup excluded)."""
    from xsched.train.loop import task_loss

    losses, times, opt = [], [], []
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    for s in range(setup["steps"]):
        inputs, targets = task.batch(s)
        inputs = tuple(x.to(dev) if isinstance(x, torch.Tensor) else x for x in inputs)
        sync(dev)
        t0 = time.perf_counter()
        loss = task_loss(task, forward(*inputs), targets)
        backward(loss)
        sync(dev)
        t1 = time.perf_counter()
        step()
        sync(dev)
        t2 = time.perf_counter()
        losses.append(float(loss))
        times.append(t2 - t0)
        opt.append(t2 - t1)
    peak = torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else None
    return {"losses": losses, "step_s": times, "optimizer_s": sum(opt), "hidden_s": 0.0, "gpu_peak": peak}


def row_reference(setup: dict[str, Any]) -> dict[str, Any]:
    """Plain PyTorch with everything on the compute device, no budget; torch's default AdamW there."""
    dev = torch.device("cpu" if setup["cpu"] else setup["device"])
    task = task_of(setup)
    model = task.model.to(dev)
    opt = torch.optim.AdamW(groups(model.parameters()), lr=LR)
    out = train_loop(setup, task, dev, model, backward_with(opt), opt.step)
    out["note"] = f"{dev.type}, AdamW on {dev.type} after the backward"
    return out


def _one_rank(backend: str) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    torch.distributed.init_process_group(backend, rank=0, world_size=1)


def row_fsdp2(setup: dict[str, Any]) -> dict[str, Any]:
    """FSDP2 (`fully_shard` per block and at the root) with CPUOffloadPolicy on a one-rank group: parameters,
    gradients and AdamW state on the host, AdamW (fused, CPU) after the backward."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    cpu = setup["cpu"]
    dev = torch.device("cpu" if cpu else setup["device"])
    _one_rank("gloo" if cpu else "nccl")
    try:
        task = task_of(setup)
        model = task.model
        mesh = init_device_mesh(dev.type, (1,))
        policy = CPUOffloadPolicy(pin_memory=not cpu)
        for block in model.h:
            fully_shard(block, mesh=mesh, offload_policy=policy)
        fully_shard(model, mesh=mesh, offload_policy=policy)
        try:
            opt, kind = torch.optim.AdamW(groups(model.parameters()), lr=LR, fused=True), "fused"
        except RuntimeError:  # fused AdamW not built for these parameters: torch's default
            opt, kind = torch.optim.AdamW(groups(model.parameters()), lr=LR), "for-loop"
        out = train_loop(setup, task, dev, model, backward_with(opt), opt.step)
        out["note"] = f"CPUOffloadPolicy, {kind} CPU AdamW after the backward"
        return out
    finally:
        torch.distributed.destroy_process_group()


def row_deepspeed(setup: dict[str, Any]) -> dict[str, Any]:
    """DeepSpeed ZeRO-Offload (stage 2, optimizer state and step on the CPU with DeepSpeedCPUAdam), fp32."""
    if setup["cpu"]:
        return {"skipped": "ZeRO-Offload needs a CUDA GPU"}
    try:
        import deepspeed
    except ImportError as e:
        return {"skipped": f"deepspeed is not installed ({e})"}
    dev = torch.device(setup["device"])
    torch.cuda.set_device(dev)
    _one_rank("nccl")
    task = task_of(setup)
    config = {
        "train_micro_batch_size_per_gpu": task.example_batch[0][0].shape[0],
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WEIGHT_DECAY}},
        "zero_optimization": {
            "stage": 2,
            "offload_optimizer": {"device": "cpu", "pin_memory": True},
            "contiguous_gradients": True,
            "overlap_comm": True,
        },
    }
    engine, _, _, _ = deepspeed.initialize(
        model=task.model, model_parameters=groups(task.model.parameters()), config=config
    )
    out = train_loop(setup, task, dev, engine, engine.backward, engine.step)
    out["note"] = f"deepspeed {deepspeed.__version__}, stage 2, CPU AdamW after the backward"
    return out


def row_torchao(setup: dict[str, Any]) -> dict[str, Any]:
    """torchao's CPUOffloadOptimizer (AdamW state and step on the host, gradients offloaded as the backward makes
    them, parameters on the GPU), fp32."""
    if setup["cpu"]:
        return {"skipped": "CPUOffloadOptimizer needs a CUDA GPU"}
    try:
        from torchao.optim import CPUOffloadOptimizer
    except ImportError as e:
        return {"skipped": f"torchao's CPUOffloadOptimizer does not import ({e})"}
    dev = torch.device(setup["device"])
    task = task_of(setup)
    model = task.model.to(dev)
    opt = CPUOffloadOptimizer(groups(model.parameters()), torch.optim.AdamW, lr=LR, fused=True)
    out = train_loop(setup, task, dev, model, backward_with(opt), opt.step)
    out["note"] = "torchao CPUOffloadOptimizer, fused CPU AdamW, parameters resident on the GPU"
    return out


# ---- the parent: run the rows, compare, print the table ----
def gib(b: float | None) -> str:
    return "-" if b is None else f"{b / 2**30:.2f} GiB" if b >= 2**28 else f"{b / 2**20:.1f} MiB"


def steady(times: list[float]) -> float:
    """The median step time after the first two steps (warm-up), or of all when there are fewer than four."""
    return statistics.median(times[2:] if len(times) >= 4 else times)


def same_losses(got: list[float], want: list[float] | None, rtol: float) -> str:
    if want is None:
        return "no reference"
    diff = max(abs(a - b) for a, b in zip(got, want))
    ok = len(got) == len(want) and all(abs(a - b) <= rtol * abs(b) for a, b in zip(got, want))
    return f"{'yes' if ok else 'NO'} (max diff {diff:.1e})"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu", action="store_true", help="the reduced mode: small GPT-2 on cpu:0 with cpu:1 as store")
    ap.add_argument("--scale", help="zoo gpt2 scale (default: 1.5B parameters on a GPU, small:n_layer=8 with --cpu)")
    ap.add_argument("--budget", help="the compute device's budget (default 16GiB on cuda:0, 3MiB on cpu:0)")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, of {', '.join(ROWS)}")
    ap.add_argument("--method", help="xsched's solver method (default park on a GPU, offload with --cpu)")
    ap.add_argument("--time-limit", type=float, default=30.0, help="xsched's solver time limit, seconds")
    ap.add_argument("--gap", type=float, help="xsched train --gap: planning stops within this gap of the lower bound")
    ap.add_argument("--profile", default="model", choices=("model", "measure"), help="xsched's costs (default model)")
    ap.add_argument("--row-timeout", type=float, default=200.0, help="seconds per row before it is stopped")
    ap.add_argument("--deadline", type=float, help="seconds for the whole run: rows are shortened or skipped")
    ap.add_argument("--loss-rtol", type=float, default=1e-4)
    ap.add_argument("--split-by", choices=("order", "time"), default="order", help="xsched_fast's --optimizer-split-by")
    ap.add_argument("--split", type=split_share, help="xsched_fast's --optimizer-split: SHARE (0-1) or auto (default)")
    ap.add_argument(
        "--llama-split", type=split_share, help="the llama row's --optimizer-split: SHARE, auto (default), 0"
    )
    ap.add_argument("--out", help="also write the markdown table here")
    ap.add_argument("--json", help="write every row's figures here as JSON, after each row")
    ap.add_argument("--trace", help="xsched rows: write the last step's Chrome trace and the plan into this folder")
    ap.add_argument(
        "--switch-interval",
        type=float,
        help="every row's GIL switch interval in seconds (sys.setswitchinterval; Python's default 0.005): whether "
        "the compute lane's waiting is for the GIL (issue 30)",
    )
    ap.add_argument("--child", choices=ROWS, help=argparse.SUPPRESS)
    ap.add_argument("--setup", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        return run_child(a.child, json.loads(a.setup), Path(a.result), _ROWS)
    if not a.cpu and not torch.cuda.is_available():
        print("no CUDA GPU: run with --cpu for the reduced mode", file=sys.stderr)
        return 2
    setup = {**(CPU if a.cpu else GPU), "cpu": a.cpu, "steps": a.steps, "time_limit": a.time_limit}
    setup["profile"] = a.profile
    setup["gap"] = a.gap
    setup["split_by"] = a.split_by
    if a.switch_interval is not None:
        if a.switch_interval <= 0:
            print(f"--switch-interval must be positive seconds, not {a.switch_interval:g}", file=sys.stderr)
            return 2
        setup["switch_interval"] = a.switch_interval
    setup.update({k: v for k, v in (("split", a.split), ("llama_split", a.llama_split)) if v is not None})
    setup.update({k: v for k, v in (("scale", a.scale), ("budget", a.budget), ("method", a.method)) if v})
    t0 = time.perf_counter()
    if a.deadline is not None:
        setup["deadline"] = time.time() + a.deadline - 3  # the report's own seconds
    if a.json:
        setup["json_out"] = a.json
    if a.trace:
        setup["trace_dir"] = str(Path(a.trace).resolve())
    results = run_rows(a.rows.split(","), setup, a.row_timeout, __file__)
    title = f"Parameters, gradients and AdamW on the host: GPT-2 {setup['scale']}"
    where = f"{setup['device']} budget {setup['budget']} for xsched, store {setup['store']}"
    return publish(title, where, __file__, argv, a, t0, results, table(results, a.loss_rtol, a.steps))


_ROWS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "reference": row_reference,
    "xsched": row_xsched,
    "xsched_allcores": row_xsched_allcores,
    "xsched_one": row_xsched_one,
    "fsdp2": row_fsdp2,
    "reference_bf16": row_reference_bf16,
    "xsched_fast": row_xsched_fast,
    "llama": row_llama,
    "deepspeed": row_deepspeed,
    "torchao": row_torchao,
}

if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main())
