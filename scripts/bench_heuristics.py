"""Benchmark the rematerialization heuristics against each other: checkpoint search (Chen-style keep sets and
DTR-style eviction), eviction alone and gap rematerialization, on random layered graphs (forward only, published
durations) and zoo training graphs (analytic costs, so the figures do not depend on this machine's noise), at
fractions of each graph's eager peak.

    python scripts/bench_heuristics.py [--graphs random_layered:500:0,gpt2:default,...] [--budgets 0.9,0.7,0.5]
                                       [--out docs/bench/heuristics.md]

Each cell: predicted time overhead over every op once (TDI) and the heuristic's wall time; every plan is replayed
by the simulator under its budget. The last column is gaps' predicted step time over the best of the others'
(below 1: gaps' plan is faster), from the same run.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from collections.abc import Callable
from pathlib import Path

from bench_solver_compare import load  # scripts/ is on sys.path when this file runs

from xsched import zoo
from xsched.capture.torch import capture
from xsched.contracts.graph import Graph
from xsched.contracts.plan import Plan
from xsched.contracts.profile import Profile
from xsched.contracts.result import HeuristicStats
from xsched.errors import BudgetError
from xsched.importers import BENCH_DEVICE
from xsched.profiling.model import cost_profile
from xsched.simulate import simulate
from xsched.solve.heuristics.checkpoint import checkpoint_search
from xsched.solve.heuristics.evict import evict_computes
from xsched.solve.heuristics.gaps import gap_remat
from xsched.solve.heuristics.routing import route_and_finish
from xsched.solve.problem import Problem
from xsched.solve.reference import eager_peak, eager_plan

GRAPHS = "random_layered:100:0,random_layered:500:0,random_layered:1000:0,gpt2:default,transformer:default,"
GRAPHS += "mlp_mixer:default,unet:default,resnet18:default,gpt2:small:n_layer=24"


def graph_of(spec: str) -> tuple[Graph, Profile, str]:
    """random_layered:N:SEED (published durations) or MODEL:SCALE (zoo, captured, analytic costs on cpu)."""
    if spec.startswith("random_layered:"):
        g, prof = load(spec)
        return g, prof, BENCH_DEVICE
    name, scale = spec.split(":", 1)
    z = zoo.build(name, scale=scale)
    g = capture(copy.deepcopy(z.model), z.inputs, name=spec)
    return g, cost_profile(g, ["cpu"]), "cpu"


def evict_only(problem: Problem) -> Plan:
    d = problem.devices[0]
    computes = evict_computes(problem.graph, d, problem.budgets[d], problem.profile)
    stats = HeuristicStats(device=d)
    return route_and_finish(
        problem.graph, computes, "evict", problem.budgets, problem.homes, problem.profile, time.perf_counter(), stats
    )


HEURISTICS: dict[str, Callable[..., Plan]] = {"checkpoint": checkpoint_search, "evict": evict_only, "gaps": gap_remat}


def cell(fn: Callable[..., Plan], graph: Graph, profile: Profile, dev: str, budget: int) -> tuple[float | None, float]:
    """(predicted time or None without a plan, wall seconds); the plan checked by the simulator."""
    t0 = time.perf_counter()
    try:
        plan = fn(Problem(graph, profile, {dev: budget}, (dev,), {v: dev for v in graph.inputs}))
    except BudgetError:
        return None, time.perf_counter() - t0
    wall = time.perf_counter() - t0
    result = simulate(graph, plan, profile)
    assert result.peak_bytes[dev] <= budget
    return result.time_s, wall


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--graphs", default=GRAPHS)
    p.add_argument("--budgets", default="0.9,0.7,0.5", help="fractions of each graph's eager peak")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    fracs = [float(x) for x in args.budgets.split(",")]
    head = "| graph | ops | budget | " + " | ".join(HEURISTICS) + " | gaps / best other |"
    rows = [head, "|" + "---|" * (head.count("|") - 1)]
    print("\n".join(rows), flush=True)
    t_all = time.perf_counter()
    for spec in args.graphs.split(","):
        graph, profile, dev = graph_of(spec)
        base, peak = eager_plan(graph, dev, profile).predicted.time_s, eager_peak(graph)
        for frac in fracs:
            got = {name: cell(fn, graph, profile, dev, int(frac * peak)) for name, fn in HEURISTICS.items()}
            cells = [
                f"+{100 * (t / base - 1):.2f}% ({w:.1f} s)" if t else f"no plan ({w:.1f} s)" for t, w in got.values()
            ]
            others = [t for name, (t, _) in got.items() if name != "gaps" and t]
            gaps = got["gaps"][0]
            ratio = f"{gaps / min(others):.3f}" if gaps and others else ("only gaps" if gaps else "-")
            rows.append(f"| {spec} | {len(graph.ops)} | {frac:.0%} | " + " | ".join(cells) + f" | {ratio} |")
            print(rows[-1], flush=True)
    rows.append(f"\nTotal {time.perf_counter() - t_all:.0f} s.")
    if args.out:
        args.out.write_text("\n".join(rows) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
