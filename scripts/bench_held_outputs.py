"""Plans whose forward output the caller holds through backward (as `wrap` holds GPT-2's logits): GPT-2 (6 layers,
batch 8, T1024) with its op costs measured on an NVIDIA H100 (benchmarks/gpu/) and the host as a store over the
measured link, at GPU budgets in % of the eager peak, planned by each method with the logits held. Per method and
budget: whether a plan is found, its predicted makespan against eager's and its predicted GPU peak (simulator
replays through `validated`, which holds the output to the end or, as the logits come from a matmul, may release
the caller's storage during backward and refill it: `contracts.holds`; no GPU runs).

    python scripts/bench_held_outputs.py --budgets 50,56,63 --methods auto,park,gaps,offload,checkpoint --limit 40
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

from xsched.contracts.graph import Graph
from xsched.contracts.profile import Profile
from xsched.errors import XschedError
from xsched.solve import solve
from xsched.solve.autograd_boundary import forward_outputs
from xsched.solve.options import SolverOptions
from xsched.solve.reference import eager_plan

DATA = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu"
GPU, HOST = "cuda:0", "cpu"


def load() -> tuple[Graph, Profile]:
    graph = Graph.load(DATA / "gpt2-full_n_layer6.graph.json.gz")
    return graph, Profile.load(DATA / "gpt2-full_n_layer6.h100.profile.json.gz")


def held(graph: Graph) -> Graph:
    """The graph as `wrap` plans it: its non-scalar forward outputs (the logits) held by the caller."""
    logits = tuple(v for v in forward_outputs(graph) if graph.value[v].shape != ())
    return dataclasses.replace(graph, held_outputs=logits)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budgets", default="50,56,63", help="GPU budgets in %% of the eager peak")
    ap.add_argument("--methods", default="auto,park,gaps,offload,checkpoint,milp")
    ap.add_argument("--limit", type=float, default=40.0, help="seconds per solve")
    a = ap.parse_args()
    graph, profile = load()
    graph = held(graph)
    eager = eager_plan(graph, GPU, profile).predicted
    print(
        f"held: {graph.held_outputs}; eager makespan {eager.makespan_s * 1e3:.1f} ms, peak {eager.peak_bytes[GPU]:,} B"
    )
    print("\n| budget | method | plan | makespan vs eager | GPU peak vs eager | wall s |")
    print("|---|---|---|---|---|---|")
    for pct in (int(x) for x in a.budgets.split(",")):
        for method in a.methods.split(","):
            t0 = time.perf_counter()
            try:
                plan = solve(
                    graph,
                    profile,
                    {GPU: f"{pct}%", HOST: 1 << 40},
                    [GPU, HOST],
                    method,
                    SolverOptions(time_limit_s=a.limit),
                )
                p = plan.predicted
                row = f"yes | {p.makespan_s / eager.makespan_s:.4f}x | {p.peak_bytes[GPU] / eager.peak_bytes[GPU]:.3f}"
            except XschedError as e:
                row = f"no ({type(e).__name__}: {str(e)[:90]}) | - | -"
            print(f"| {pct}% | {method} | {row} | {time.perf_counter() - t0:.0f} |", flush=True)


if __name__ == "__main__":
    main()
