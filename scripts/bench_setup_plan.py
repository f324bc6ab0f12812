"""Setup time of `xsched train --param-home cpu --store cpu` on GPT-2 1.56B, without a GPU (issue 30 item 4): the
training graph built and captured as `xsched train` does, priced on the measured H100 spec (the sim plugin, the host
as the store), then planned per method and GPU budget with the weights homed on the host.

    python scripts/bench_setup_plan.py [--scale full:n_layer=48,n_head=25,n_embd=1600,seq=512,batch=2,dropout=0.0]
        [--runs park:16GiB,park:8GiB,auto:16GiB,auto:8GiB] [--time-limit 60] [--save graph.pkl | --load graph.pkl]

Prints the seconds (wall and this process's CPU) of each stage, and per plan its predicted step and GPU peak, or
its one-line error. `--save`/`--load` keep the captured graph and its costs, so planning can be timed alone."""

from __future__ import annotations

import argparse
import pickle
import tempfile
import time

import torch

from xsched.capture.torch import capture
from xsched.errors import XschedError
from xsched.execute.param_home import param_homes
from xsched.loaders import load_training_task
from xsched.pipeline import plan_profile
from xsched.solve import SolverOptions, solve
from xsched.train.session import grad_outputs, graph_name

GPU, HOST = "sim:h100-measured", "cpu"
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


def build(scale: str, clock: Clock) -> tuple:
    """The training graph `xsched train` captures for zoo:gpt2 at `scale`, and its costs on the H100 spec."""
    torch.manual_seed(0)
    task = load_training_task("zoo:gpt2", None, scale, 0)
    print(f"model     {clock.lap()}", flush=True)
    graph = capture(task.model, task.example_batch[0], name=graph_name("zoo:gpt2"), grad_outputs=grad_outputs(task))
    print(f"capture   {clock.lap()}  {len(graph.ops)} ops", flush=True)
    del task
    with tempfile.TemporaryDirectory() as where:  # the sim device's roofline, the copies over the spec's host link
        profile = plan_profile(graph, [GPU, HOST], "measure", where, stores=[HOST])
    print(f"profile   {clock.lap()}", flush=True)
    return graph, profile


def plan_once(graph, profile, method: str, budget: str, time_limit: float) -> str:
    """One plan as `xsched train` asks for it: the weights homed on the host, the host as the store."""
    options = SolverOptions(time_limit_s=time_limit)
    budgets = {GPU: budget, HOST: "100GiB"}
    try:
        plan = solve(graph, profile, budgets, [GPU, HOST], method, options=options, homes=param_homes(graph, HOST))
    except XschedError as e:
        return f"{type(e).__name__}: {e.detail[:160]}"
    p = plan.predicted
    return f"step {p.time_s * 1e3:.1f} ms, GPU peak {p.peak_bytes[GPU] / 2**30:.2f} GiB, by {plan.solver.found_by}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scale", default=SCALE)
    ap.add_argument("--runs", default="park:16GiB,park:8GiB,auto:16GiB,auto:8GiB", help="method:budget, ...")
    ap.add_argument("--time-limit", type=float, default=60.0, help="as `xsched train`'s default")
    ap.add_argument("--save", help="pickle the graph and its costs here")
    ap.add_argument("--load", help="plan a graph and costs pickled by --save")
    args = ap.parse_args()
    clock = Clock()
    if args.load:
        with open(args.load, "rb") as f:
            graph, profile = pickle.load(f)
    else:
        graph, profile = build(args.scale, clock)
    if args.save:
        with open(args.save, "wb") as f:
            pickle.dump((graph, profile), f)
    clock.lap()
    for run in args.runs.split(","):
        method, budget = run.split(":")
        result = plan_once(graph, profile, method, budget, args.time_limit)
        print(f"{method:6} {budget:>6} {clock.lap()}  {result}", flush=True)


if __name__ == "__main__":
    main()
