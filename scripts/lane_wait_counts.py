"""The lanes' hand-offs a step of a plan, before and after the waits' transitive reduction (issue 30): frees run
inline on the compute lane, cross-lane waits, and the executor's tasks (compute lane / all), counted from the plan
without running it. "before" is the unreduced model (xsched.lanes.direct_waits, a free inline only when those
waits are all on its compute lane), "after" the executor's (step_waits, inline_free_lanes).

    python scripts/lane_wait_counts.py --bench-cache CACHE   # bench_host_overhead.py --cache-dir CACHE's park plan
    python scripts/lane_wait_counts.py --load graph.pkl --budget 16GiB        # bench_setup_plan.py --save's graph
"""

from __future__ import annotations

import argparse
import sys
from types import SimpleNamespace
from typing import Any

from xsched.contracts.graph import Graph
from xsched.contracts.plan import Compute, Free, Plan
from xsched.contracts.random_ops import random_ops
from xsched.execute.lane_run import LaneRunner
from xsched.lanes import direct_waits, inline_free_lanes, lane_of, step_waits


def old_lanes(graph: Graph, plan: Plan, randoms: Any) -> list[str]:
    """The rule before the reduction: a free inline when its unreduced waits are all on its compute lane."""
    lanes = [lane_of(s) for s in plan.steps]
    for i, deps in enumerate(direct_waits(graph, plan.steps, randoms)):
        s = plan.steps[i]
        if isinstance(s, Free) and all(lanes[j] == f"compute:{s.device}" for j in deps):
            lanes[i] = f"compute:{s.device}"
    return lanes


def counts(plan: Plan, lanes: list[str], waits: list[tuple[int, ...]]) -> dict[str, int]:
    steps = plan.steps
    runner = SimpleNamespace(ex=SimpleNamespace(deps=waits, lane_of=lanes), _groups={})
    tasks = LaneRunner.tasks(runner, 0, len(steps))  # type: ignore[arg-type]  # the executor's grouping, no run
    return {
        "frees inline": sum(isinstance(s, Free) and k.startswith("compute:") for s, k in zip(steps, lanes)),
        "cross-lane waits": sum(len(w) for w in waits),
        "computes waiting for a free-lane step": sum(
            isinstance(s, Compute) and any(lanes[j].startswith("free:") for j in w) for s, w in zip(steps, waits)
        ),
        "free-lane steps waiting for a compute": sum(
            lanes[i].startswith("free:") and any(lanes[j].startswith("compute:") for j in w)
            for i, w in enumerate(waits)
        ),
        "compute-lane tasks": sum(lanes[g[0]].startswith("compute:") for g in tasks),
        "tasks": len(tasks),
    }


def bench_plan(cache_dir: str, layers: int, embd: int, seq: int, budget: str) -> tuple[Graph, Plan]:
    """bench_host_overhead's lanes row's graph and plan: its `xsched train` session, the plan from its cache."""
    sys.path.insert(0, "scripts")
    from bench_param_offload_rows import offload_config

    from xsched.train import dist
    from xsched.train.records import Quiet
    from xsched.train.session import placement, prepare

    setup = {"device": "cpu:0", "store": "cpu:1", "host_budget": "1GiB", "steps": 1, "method": "park"}
    setup.update(time_limit=60.0, profile="model", cache_dir=cache_dir)
    scale = f"tiny:n_layer={layers},n_embd={embd},n_head=2,seq={seq},batch=1,dropout=0.0"  # the bench's scale_of
    config = offload_config(setup, "gpt2", scale, budget)
    config.check()
    budgets, devices = placement(config, 0)
    world = dist.join(use_cuda=False)
    session, _ = prepare(config, budgets, devices, world, Quiet())
    try:
        ex = session.wrapped._first.executor
        return ex.graph, ex.plan
    finally:
        session.updater.close()
        dist.leave(world)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--load", help="a (graph, profile) pickle from bench_setup_plan.py --save: plan it with park")
    ap.add_argument("--budget", default="16GiB", help="--load: the GPU's budget")
    ap.add_argument("--bench-cache", help="bench_host_overhead's --cache-dir, its park plan in it")
    ap.add_argument("--bench-budget", default="12MiB", help="--bench-cache: the bench's --budget")
    ap.add_argument("--layers", type=int, default=48, help="--bench-cache: the bench's --layers")
    ap.add_argument("--embd", type=int, default=64)
    ap.add_argument("--seq", type=int, default=16)
    a = ap.parse_args(argv)
    if a.load:
        import pickle

        sys.path.insert(0, "scripts")
        from bench_setup_plan import GPU, HOST

        from xsched.execute.param_home import param_homes
        from xsched.solve import solve

        with open(a.load, "rb") as f:
            graph, profile = pickle.load(f)
        budgets = {GPU: a.budget, HOST: "100GiB"}
        plan = solve(graph, profile, budgets, [GPU, HOST], "park", homes=param_homes(graph, HOST))
    elif a.bench_cache:
        graph, plan = bench_plan(a.bench_cache, a.layers, a.embd, a.seq, a.bench_budget)
    else:
        print("lane_wait_counts: give --load or --bench-cache", file=sys.stderr)
        return 2
    randoms = random_ops(graph)
    before_lanes = old_lanes(graph, plan, randoms)
    before = counts(plan, before_lanes, direct_waits(graph, plan.steps, randoms, before_lanes))
    after_lanes = inline_free_lanes(graph, plan.steps, randoms)
    after = counts(plan, after_lanes, step_waits(graph, plan.steps, randoms, after_lanes))
    frees = sum(isinstance(s, Free) for s in plan.steps)
    print(f"{graph.name}: {len(graph.ops)} ops, {len(plan.steps)} steps, {frees} frees\n")
    print("| a step | before | after |\n|---|---|---|")
    for k in before:
        print(f"| {k} | {before[k]:,} | {after[k]:,} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
