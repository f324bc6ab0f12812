"""Plans offline on GPT-2 (6 layers, batch 8, T1024) with the costs and host links measured on an H100 on
2026-11-27 (benchmarks/gpu/*.h100-20261127.*): one solve per call, at torch checkpoint's measured step peak or a
% of the eager peak, on the GPU alone or with the host store, printed (and appended to --jsonl) as predicted
makespan / the whole-loss graph's eager predicted makespan (for the chunked graph too, as the bench's "vs eager"),
step peak above the resident inputs (and over eager's), solve time and status. One solve per process, as
scripts/bench_gpu_memory.py solves each row in a fresh process.

    python scripts/bench_h100_budgets.py --budget ckpt --method auto --limit 20
    python scripts/bench_h100_budgets.py --budget 45 --method auto --limit 20
    python scripts/bench_h100_budgets.py --budget 25 --store --chunk8 --method auto --limit 60
"""

from __future__ import annotations

import argparse
import gzip
import json
import time
from pathlib import Path

from xsched.contracts.graph import Graph
from xsched.contracts.plan import Compute, Copy
from xsched.contracts.profile import Profile
from xsched.errors import XschedError
from xsched.simulate import simulate
from xsched.solve import SolverOptions, solve
from xsched.solve.reference import eager_peak, eager_plan

DATA = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu"
GPU, HOST = "cuda:0", "cpu"
STORE_BYTES = 64 << 30  # the bench's host budget (64 GiB)
# torch.utils.checkpoint per block, measured in that run: step peak above the resident state (gpu_memory.json)
CKPT_STEP_PEAK = 6_794_977_792


def load(stem: str) -> tuple[Graph, Profile]:
    """A graph and its profile from benchmarks/gpu, shipped gzipped."""

    def read(what: str) -> dict:
        with gzip.open(DATA / f"{stem}.h100-20261127.{what}.json.gz", "rt") as f:
            return json.load(f)

    return Graph.from_dict(read("graph")), Profile.from_dict(read("profile"))


def gpu_budget(graph: Graph, budget: str) -> int:
    """The GPU's budget in bytes: `ckpt` is the resident inputs plus checkpoint's measured step peak (the bench's
    "at checkpoint's peak" row); a number is that % of the (unchunked) graph's eager peak, as the bench's rows."""
    if budget == "ckpt":
        return sum(graph.value[v].nbytes for v in graph.inputs) + CKPT_STEP_PEAK
    return eager_peak(graph) * int(budget) // 100


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--budget", default="ckpt", help="ckpt, or a GPU budget in %% of the eager peak")
    ap.add_argument("--store", action="store_true", help="the host as a store (64 GiB)")
    ap.add_argument("--chunk8", action="store_true", help="the graph with its loss in 8 chunks")
    ap.add_argument("--method", default="auto")
    ap.add_argument("--limit", type=float, default=20.0)
    ap.add_argument("--jsonl", help="append the row here")
    ap.add_argument("--save", help="write the plan here (xsched.plan/1 JSON)")
    a = ap.parse_args(argv)
    # budgets, eager time and eager peak of the whole-loss graph, for the chunked one too (the bench's "vs eager")
    graph, profile = load("gpt2-full_n_layer6")
    gpu = gpu_budget(graph, a.budget)
    resident = sum(graph.value[v].nbytes for v in graph.inputs)
    eager = simulate(graph, eager_plan(graph, GPU, profile), profile)
    eager_s, eager_step_peak = eager.makespan_s, eager.peak_bytes[GPU] - resident
    if a.chunk8:
        graph, profile = load("gpt2-full_n_layer6-chunk8")
    budgets = {GPU: gpu, **({HOST: STORE_BYTES} if a.store else {})}
    row: dict = {"budget": a.budget, "store": a.store, "chunk8": a.chunk8, "method": a.method, "limit": a.limit}
    row["gpu_budget"] = gpu
    t0 = time.perf_counter()
    try:
        plan = solve(graph, profile, budgets, list(budgets), a.method, SolverOptions(time_limit_s=a.limit))
    except XschedError as e:
        row |= {"error": e.detail, "solve_s": time.perf_counter() - t0}
    else:
        row["solve_s"] = time.perf_counter() - t0
        sim = simulate(graph, plan, profile)
        if a.save:
            plan.save(a.save)
        members = getattr(plan.solver.stats, "members", ())
        row |= {
            "ratio": sim.makespan_s / eager_s,
            "peak": sim.peak_bytes[GPU] - resident,
            "peak_vs_eager": (sim.peak_bytes[GPU] - resident) / eager_step_peak,
            "status": plan.solver.status,
            "gap": plan.solver.gap,
            "found_by": getattr(plan.solver.stats, "found_by", None) or plan.solver.method,
            "recomputes": sum(isinstance(s, Compute) for s in plan.steps) - len(graph.ops),
            "copies": sum(isinstance(s, Copy) for s in plan.steps),
            "members": [(m.method, m.status, m.seconds, m.objective and m.objective / eager_s) for m in members],
        }
    print(json.dumps(row), flush=True)
    if a.jsonl:
        with open(a.jsonl, "a") as f:
            f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
