"""Setup time of `xsched train --param-home cpu --store cpu` on GPT-2 1.56B (or the Llama 3.2B row), without a GPU
(issue 30 item 4): the training graph built and captured as `xsched train` does, priced on the measured H100 spec
(the sim plugin, the host as the store), then planned per method and GPU budget with the weights homed on the host.

    python scripts/bench_setup_plan.py [--model gpt2] [--scale full:n_layer=48,n_head=25,n_embd=1600,seq=512,batch=2,dropout=0.0]
        [--precision fp32|bf16] [--empty] [--runs park:16GiB,park:8GiB,auto:16GiB,auto:8GiB] [--time-limit 60] [--gap G]
        [--save graph.pkl | --load graph.pkl] [--blocks reuse|both] [--capture-only]
        [--split 0,0.2,auto --host-rate 2.2e9 --device-rate 60e9]
    python scripts/bench_setup_plan.py --model llama --scale full:seq=1024,batch=4 --precision bf16 --runs park:70GiB

Prints the seconds (wall and this process's CPU) of each stage, and per plan its predicted step and GPU peak, or
its one-line error. The stages are `xsched train`'s: the model, the loss's outputs (a fake forward), the capture, the
capture `wrap` repeats (within the session's `captured_once()`, so reused), the costs, the plans. `--precision bf16`
captures as `--precision bf16 --param-home cpu` does (bf16 weights, under autocast); `--empty` builds the model on
the meta device and gives it uninitialised memory (its ties kept), as planning reads shapes only: the graph is the
same (tests/test_bench_setup_plan.py), the model stage is not the training run's. `--save`/`--load` keep the
captured graph and its costs, so planning can be timed alone. `--blocks reuse` captures with `reuse_blocks=True`
(a few of the identical blocks traced, the rest extrapolated); `--blocks both` then also captures every block, in a
scope of its own, and says whether the two graphs are the same; `--capture-only` stops after the capture. `--split`
plans each run with the optimizer split at each share instead (a number: the parameters the backward releases last,
as `--optimizer-split SHARE`; auto: `--optimizer-split auto`) and prints its predicted step with the host's and the
GPU's AdamW at the rates given (xsched.train.split_auto.plan_step) and the seconds the split's planning took."""

from __future__ import annotations

import argparse
import dataclasses
import pickle
import tempfile
import time
from functools import partial

import torch
from torch import nn

from xsched import zoo
from xsched.budgets import parse_budget
from xsched.capture.reuse import captured_once
from xsched.capture.torch import capture
from xsched.devices.spec import target_device_type
from xsched.errors import XschedError
from xsched.execute.param_home import param_homes
from xsched.loaders import TrainingTask, load_training_task
from xsched.pipeline import plan_profile
from xsched.solve import SolverOptions, solve
from xsched.train.optim import autocast
from xsched.train.plan_wrap import grad_outputs, graph_name
from xsched.zoo import drawn_once, tasks

GPU, HOST = "sim:h100-measured", "cpu"
TYPED = target_device_type([GPU, HOST])  # as `xsched train` types its capture for its devices: a GPU's kernels
SCALE = "full:n_layer=48,n_head=25,n_embd=1600,seq=512,batch=2,dropout=0.0"  # bench_gpu_param_offload's GPU scale


class Clock:
    """Wall and CPU seconds since the last lap."""

    def __init__(self) -> None:
        self.wall, self.cpu = time.perf_counter(), time.process_time()

    def lap(self) -> str:
        wall, cpu = time.perf_counter(), time.process_time()
        text = f"{wall - self.wall:7.1f} s wall {cpu - self.cpu:7.1f} s cpu"
        self.wall, self.cpu = wall, cpu
        return text


def empty_model(name: str, scale: str, dtype: torch.dtype | None = None) -> nn.Module:
    """Zoo model `name` built on the meta device (cast to `dtype` there), then given uninitialised CPU memory: its
    shapes, dtypes and tied parameters as built (to_empty would untie them), none of the initialisation's compute."""
    model = zoo.build_module(name, scale, device="meta")
    if dtype is not None:
        model.to(dtype)
    return drawn_once.materialized(model, "cpu")


def load_task(name: str, scale: str, precision: str, empty: bool) -> TrainingTask:
    """The training task `xsched train zoo:NAME --precision P --param-home cpu` runs (seed 0): the model cast to
    bf16 for bf16 (its fp32 masters are the host optimizer's), built empty where asked."""
    dtype = torch.bfloat16 if precision == "bf16" else None
    if not empty:
        task = load_training_task(f"zoo:{name}", None, scale, 0)
        if dtype is not None:
            task.model.to(dtype)
        return task
    stream = partial(tasks.task_batch, name, scale, zoo.config(name, scale).batch, seed=0)
    return TrainingTask(f"zoo:{name}", empty_model(name, scale, dtype), stream(0), tasks.task_loss(name), stream)


def build(
    name: str, scale: str, precision: str, empty: bool, clock: Clock, blocks: str = "", only: bool = False
) -> tuple:
    """The training graph `xsched train` captures for zoo `name` at `scale` and `precision`, and its costs on the
    H100 spec. The capture wrap repeats runs too, as in the session (reused within `captured_once()`)."""
    torch.manual_seed(0)
    task = load_task(name, scale, precision, empty)
    print(f"model     {clock.lap()}", flush=True)
    with autocast(precision, ("cuda",)), captured_once():
        grads = grad_outputs(task)
        print(f"loss outs {clock.lap()}", flush=True)
        reuse = blocks in ("reuse", "both")
        traced = partial(capture, task.model, task.example_batch[0], grad_outputs=grads, device_type=TYPED)
        graph = traced(name=graph_name(f"zoo:{name}"), reuse_blocks=reuse)
        print(f"capture   {clock.lap()}  {len(graph.ops)} ops{', blocks reused' if reuse else ''}", flush=True)
        if blocks == "both":
            with captured_once():  # a scope of its own: the full trace, not the graph above again
                full = traced(name=graph_name(f"zoo:{name}"))
            same = full == graph and full.fingerprint == graph.fingerprint
            print(
                f"full      {clock.lap()}  {len(full.ops)} ops, every block traced; the same graph: {same}", flush=True
            )
        again = traced(name=type(task.model).__name__)
        print(f"wrap's    {clock.lap()}  the same graph: {again.fingerprint == graph.fingerprint}", flush=True)
    del task
    if only:
        return graph, None
    with tempfile.TemporaryDirectory() as where:  # the sim device's roofline, the copies over the spec's host link
        profile = plan_profile(graph, [GPU, HOST], "measure", where, stores=[HOST])
    print(f"profile   {clock.lap()}", flush=True)
    return graph, profile


def plan_once(graph, profile, method: str, budget: str, time_limit: float, gap: float | None = None) -> str:
    """One plan as `xsched train` asks for it: the weights homed on the host, the host as the store."""
    options = SolverOptions(time_limit_s=time_limit)
    if gap is not None:  # as `xsched train --gap`
        options = dataclasses.replace(options, mip_gap=gap)
    budgets = {GPU: budget, HOST: "100GiB"}
    try:
        plan = solve(graph, profile, budgets, [GPU, HOST], method, options=options, homes=param_homes(graph, HOST))
    except XschedError as e:
        return f"{type(e).__name__}: {e.detail[:160]}"
    p, r = plan.predicted, plan.solver
    return (
        f"makespan {(p.makespan_s or p.time_s) * 1e3:.1f} ms (sequential {p.time_s * 1e3:.1f} ms), GPU peak "
        f"{p.peak_bytes[GPU] / 2**30:.2f} GiB, by {r.found_by}, {r.status}, gap {'-' if r.gap is None else f'{r.gap:.1%}'}"
    )


@dataclasses.dataclass(frozen=True)
class Solved:
    """A plan and its costs, as the split's search takes them (xsched.train.split_auto.Planned)."""

    plan: object
    profile: object


def split_once(graph, profile, method: str, budget: str, share: str, rates: tuple[float, float], opts) -> str:
    """The optimizer split at `share` of the GPU budget ("0": none; a number: the parameters released last, as
    the bench's llama row by default; "auto": chosen by the planner) as `xsched train --optimizer-split` plans it,
    and its predicted step with AdamW at `rates` (parameters/s on the host, on the GPU)."""
    from xsched.execute.param_home import ListenerSlot, ParamPoints
    from xsched.train.placement import split_plan
    from xsched.train.split_auto import choose_auto, plan_step

    budgets, homes = {GPU: budget, HOST: "100GiB"}, param_homes(graph, HOST)

    def solve_split(limits, placed) -> Solved:
        return Solved(solve(graph, profile, limits, [GPU, HOST], method, options=opts, homes=placed), profile)

    try:
        home = solve_split(budgets, homes)
        if share == "auto":
            auto = choose_auto(graph, home, GPU, HOST, budgets, homes, rates, solve_split)
            split, chosen, why = auto.split, auto.planned, f"; stopped: {auto.stopped}"
        elif float(share) > 0:
            order = ParamPoints(graph, home.plan, ListenerSlot()).order
            split, chosen = split_plan(graph, order, GPU, budgets, float(share), solve_split, homes)
            why = ""
        else:
            split, chosen, why = None, home, ""
    except XschedError as e:
        return f"{type(e).__name__}: {e.detail[:160]}"
    step, late = plan_step(graph, chosen, HOST, *rates)
    run = chosen.plan.predicted.makespan_s or chosen.plan.predicted.time_s
    moved, state = (len(split.params), split.state_bytes) if split else (0, 0)
    peak = chosen.plan.predicted.peak_bytes[GPU] + state
    return (
        f"share {(split.bytes if split else 0) / parse_budget(budget):.3f}, {moved} parameters moved, predicted "
        f"step {step * 1e3:.1f} ms (run {run * 1e3:.1f} ms, host AdamW late {late * 1e3:.1f} ms), GPU peak "
        f"{peak / 2**30:.2f} GiB with the moved state{why}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt2", help="a zoo model")
    ap.add_argument("--scale", default=SCALE)
    ap.add_argument("--precision", default="fp32", choices=("fp32", "bf16"))
    ap.add_argument("--empty", action="store_true", help="build the model on the meta device, then empty memory")
    ap.add_argument("--runs", default="park:16GiB,park:8GiB,auto:16GiB,auto:8GiB", help="method:budget, ...")
    ap.add_argument("--time-limit", type=float, default=60.0, help="as `xsched train`'s default")
    ap.add_argument("--gap", type=float, help="as `xsched train --gap`: auto stops within this gap of the bound")
    ap.add_argument("--save", help="pickle the graph and its costs here")
    ap.add_argument("--load", help="plan a graph and costs pickled by --save")
    ap.add_argument("--blocks", default="", choices=("", "reuse", "both"), help="capture with reuse_blocks")
    ap.add_argument("--capture-only", action="store_true", help="stop after the capture")
    ap.add_argument("--split", help="optimizer splits per run instead: shares of the GPU budget, e.g. 0,0.2,auto")
    ap.add_argument("--host-rate", type=float, default=2.2e9, help="--split: the host AdamW's parameters/s")
    ap.add_argument("--device-rate", type=float, default=60e9, help="--split: the GPU AdamW's parameters/s")
    args = ap.parse_args()
    clock = Clock()
    if args.load:
        with open(args.load, "rb") as f:
            graph, profile = pickle.load(f)
    else:
        graph, profile = build(
            args.model, args.scale, args.precision, args.empty, clock, args.blocks, args.capture_only
        )
        if args.capture_only:
            return
    if args.save:
        with open(args.save, "wb") as f:
            pickle.dump((graph, profile), f)
    clock.lap()
    for run in args.runs.split(","):
        method, budget = run.split(":")
        if args.split:
            opts = SolverOptions(time_limit_s=args.time_limit)
            opts = dataclasses.replace(opts, mip_gap=args.gap) if args.gap is not None else opts
            for share in args.split.split(","):
                result = split_once(graph, profile, method, budget, share, (args.host_rate, args.device_rate), opts)
                print(f"{method:6} {budget:>6} split {share:>4} {clock.lap()}  {result}", flush=True)
            continue
        result = plan_once(graph, profile, method, budget, args.time_limit, args.gap)
        print(f"{method:6} {budget:>6} {clock.lap()}  {result}", flush=True)


if __name__ == "__main__":
    main()
