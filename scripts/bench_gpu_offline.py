"""Heterogeneity offline: GPT-2 (6 layers, batch 8, sequence 1024) with its op costs measured on an NVIDIA H200
(benchmarks/gpu/), planned here by `auto` on the GPU alone and with the host as a store over a link of a given
speed, at budgets in % of the eager peak. Predicted makespans (the lanes model) against the eager step; no GPU
runs here.

    python scripts/bench_gpu_offline.py --link 57 --budgets 45,50 --limit 60
    python scripts/bench_gpu_offline.py --link 450 --budgets 55 --limit 60
    python scripts/bench_gpu_offline.py --link 57 --budgets 42,45,48,51,54,57,60,63 --limit 60

The issue's targets (docs/BENCHMARKS.md): at 450 GB/s and 55%, a makespan of at most 1.08x eager; at 57 GB/s and
45% and 50%, the store removes at least a third of the GPU-alone plan's overhead; with the store never slower.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

from xsched.contracts.graph import Graph
from xsched.contracts.plan import Compute, Copy
from xsched.contracts.profile import DeviceInfo, LinkCost, Profile
from xsched.errors import XschedError
from xsched.simulate import simulate
from xsched.solve import SolverOptions, solve
from xsched.solve.bounds.memory import lower_bounds
from xsched.solve.bounds.time import time_bound
from xsched.solve.reference import eager_peak, eager_plan

DATA = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu"
GPU, HOST = "cuda:0", "cpu"
LATENCY_S = 5e-6  # the H200's host link: 3.6-6.8 us (benchmarks/gpu/README.md)


def load() -> tuple[Graph, Profile]:
    """The captured graph and its H200 profile, shipped gzipped."""

    def read(name: str) -> dict:
        with gzip.open(DATA / name, "rt") as f:
            return json.load(f)

    return Graph.from_dict(read("gpt2-full_n_layer6.graph.json.gz")), Profile.from_dict(
        read("gpt2-full_n_layer6.h200.profile.json.gz")
    )


def with_host_store(profile: Profile, gb_per_s: float) -> Profile:
    """The profile with the host as a store (no compute) over a link of `gb_per_s` each way."""
    link = LinkCost(LATENCY_S, gb_per_s * 1e9)
    devices = {**profile.devices, HOST: DeviceInfo("cpu", "host", 1 << 40)}
    return replace(profile, devices=devices, copy={f"{GPU}->{HOST}": link, f"{HOST}->{GPU}": link})


def plan_row(
    graph: Graph, profile: Profile, pct: int, store: bool, limit: float, eager_s: float, params_on_host: bool = False
) -> dict:
    budgets = {GPU: f"{pct}%", **({HOST: 1 << 40} if store else {})}
    devices = [GPU, HOST] if store else [GPU]
    homes = {v: HOST for v in graph.inputs if graph.value[v].kind in ("param", "buffer")} if params_on_host else None
    t0 = time.perf_counter()
    try:
        plan = solve(graph, profile, budgets, devices, options=SolverOptions(time_limit_s=limit), homes=homes)
    except XschedError as e:
        return {"pct": pct, "store": store, "error": e.detail.split(";")[0], "solve_s": time.perf_counter() - t0}
    sim = simulate(graph, plan, profile)
    computes = sum(isinstance(s, Compute) for s in plan.steps)
    return {
        "pct": pct,
        "store": store,
        "makespan": sim.makespan_s / eager_s,
        "sequential": sim.time_s / eager_s,
        "recomputes": computes - len(graph.ops),
        "copies": sum(isinstance(s, Copy) for s in plan.steps),
        "moved_gib": sim.copy_bytes / 2**30,
        "found_by": plan.solver.found_by,
        "status": plan.solver.status,
        "gap": plan.solver.gap,
        "solve_s": time.perf_counter() - t0,
    }


def params_on_host(graph: Graph, stored: Profile, a: argparse.Namespace, eager_s: float) -> int:
    """Weights on the host: the lowest budget `auto` plans (going down the budgets given), its makespan, and the
    physical floor of moving every weight in and every gradient out over the link against the compute time."""
    params = [v for v in graph.inputs if graph.value[v].kind in ("param", "buffer")]
    weights = sum(graph.value[v].nbytes for v in params)
    grads = sum(v.nbytes for v in graph.values if v.grad_of in set(params))
    link = stored.link(GPU, HOST)
    floor_in, floor_out = weights / link.bytes_per_s, grads / link.bytes_per_s
    bound = lower_bounds(graph, stored, [GPU, HOST], {v: HOST if v in params else GPU for v in graph.inputs})[GPU]
    print(
        f"weights {weights / 2**20:.0f} MiB in: {floor_in * 1e3:.1f} ms, gradients {grads / 2**20:.0f} MiB out: "
        f"{floor_out * 1e3:.1f} ms, against {eager_s * 1e3:.1f} ms of compute; the GPU's proven lower bound "
        f"{bound.bytes / eager_peak(graph):.1%} of the eager peak ({bound.by})"
    )
    print("\n| GPU budget | makespan vs eager | copies / GiB moved / recomputes | found by |\n|---|---|---|---|")
    for pct in (int(x) for x in a.budgets.split(",")):
        row = plan_row(graph, stored, pct, True, a.limit, eager_s, params_on_host=True)
        if "error" in row:
            print(f"| {pct}% | no plan: {row['error'][:120]} | | |")
            continue
        moved = f"{row['copies']} / {row['moved_gib']:.2f} / {row['recomputes']}"
        print(f"| {pct}% | {row['makespan']:.4f}x | {moved} | {row['found_by']} |", flush=True)
    return 0


def cell(row: dict) -> str:
    return row["error"] if "error" in row else f"{row['makespan']:.4f}x"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--link", type=float, default=57.0, help="host link GB/s each way (H200 measured: 57)")
    ap.add_argument("--budgets", default="45,50,55", help="GPU budgets in %% of the eager peak")
    ap.add_argument("--limit", type=float, default=60.0, help="auto's time limit per plan, seconds")
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--params-on-host", action="store_true", help="weights homed on the host store (issue 25)")
    a = ap.parse_args(argv)
    graph, profile = load()
    stored = with_host_store(profile, a.link)
    eager_s = eager_plan(graph, GPU, profile).predicted.time_s
    if a.params_on_host:
        return params_on_host(graph, stored, a, eager_s)
    bound = time_bound(graph, stored, [GPU, HOST], {v: GPU for v in graph.inputs})
    print(f"eager step (predicted) {eager_s * 1e3:.1f} ms; makespan bound {bound.seconds / eager_s:.3f}x ({bound.by})")
    rows = []
    for pct in (int(x) for x in a.budgets.split(",")):
        alone = plan_row(graph, profile, pct, False, a.limit, eager_s)
        parked = plan_row(graph, stored, pct, True, a.limit, eager_s)
        rows += [alone, parked]
        print(f"  {pct}%: alone {cell(alone)}, store {cell(parked)}", file=sys.stderr, flush=True)
    print(
        f"\n| budget | GPU alone | with the {a.link:g} GB/s host store | overhead removed | store: copies / GiB moved"
        " / recomputes | found by (alone / store) |"
    )
    print("|---|---|---|---|---|---|")
    for alone, parked in zip(rows[::2], rows[1::2]):
        if "error" in alone or "error" in parked:
            print(f"| {alone['pct']}% | {cell(alone)} | {cell(parked)} | - | - | - |")
            continue
        removed = 1 - (parked["makespan"] - 1) / (alone["makespan"] - 1) if alone["makespan"] > 1 else 0.0
        print(
            f"| {alone['pct']}% | {alone['makespan']:.4f}x | {parked['makespan']:.4f}x | {removed:.0%} | "
            f"{parked['copies']} / {parked['moved_gib']:.2f} / {parked['recomputes']} | "
            f"{alone['found_by']} / {parked['found_by']} |"
        )
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
