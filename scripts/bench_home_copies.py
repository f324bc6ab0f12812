"""Copies home issued early: GPT-2 (6 layers, benchmarks/gpu/) with every weight homed on the host store (57 GB/s
each way), planned by one heuristic at a time at GPU budgets in % of the eager peak; or (`--zoo`) zoo models at
scale tiny, captured, with modelled costs on cpu:0 and their weights homed on cpu:1, a store (or, with
`--home-computes`, a second device that runs ops too), at budgets on cpu:0 in % of the eager peak. Per plan: the predicted
makespan, the GPU's peak, how many gradients' copies home it issues before its last compute, and when the last copy
home ends after the last compute (a tail). Predicted by the simulator, no GPU runs; run it on two commits to compare
(it uses only xsched.solve and the stored graph and profiles).

    python scripts/bench_home_copies.py --card h200 --methods offload,checkpoint --budgets 60,50,45
    python scripts/bench_home_copies.py --zoo gpt2,mlp_mixer --home-computes --methods greedy,fastest --budgets 90,70
"""

from __future__ import annotations

import argparse
import copy
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

from xsched import zoo
from xsched.capture.torch import capture
from xsched.contracts.graph import Graph
from xsched.contracts.plan import Compute, Copy, Plan, required_homes
from xsched.contracts.profile import DeviceInfo, LinkCost, Profile
from xsched.errors import XschedError
from xsched.execute.param_home import param_homes
from xsched.profiling.model import cost_profile
from xsched.simulate import simulate
from xsched.solve import SolverOptions, solve
from xsched.solve.reference import eager_peak

DATA = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu"
GPU, HOST = "cuda:0", "cpu"


def load(card: str) -> tuple[Graph, Profile]:
    """The graph and the card's measured costs, the host as a store over a 57 GB/s link each way."""
    graph = Graph.load(DATA / "gpt2-full_n_layer6.graph.json.gz")
    prof = Profile.load(DATA / f"gpt2-full_n_layer6.{card}.profile.json.gz")
    link = LinkCost(5e-6, 57e9)
    devices = {**prof.devices, HOST: DeviceInfo("cpu", "host", 1 << 40)}
    return graph, replace(prof, devices=devices, copy={f"{GPU}->{HOST}": link, f"{HOST}->{GPU}": link})


def home_copies(graph: Graph, plan: Plan, profile: Profile) -> tuple[int, int, float]:
    """(copies home before the last compute, copies home, seconds the last copy home ends after the last compute)."""
    must_end = required_homes(graph, plan.homes)
    steps = plan.steps
    spans = simulate(graph, plan, profile).step_span
    last = max(i for i, s in enumerate(steps) if isinstance(s, Compute))
    home = [i for i, s in enumerate(steps) if isinstance(s, Copy) and must_end.get(s.value) == s.dst]
    tail = max((spans[i][1] for i in home), default=0.0) - spans[last][1]
    return sum(i < last for i in home), len(home), max(tail, 0.0)


Case = tuple[str, Graph, Profile, str, str]  # label, graph, profile, compute device, the weights' home


def cases(args: argparse.Namespace) -> Iterator[Case]:
    if not args.zoo:
        graph, profile = load(args.card)
        yield f"GPT-2 6 layers ({args.card})", graph, profile, GPU, HOST
    for name in filter(None, args.zoo.split(",")):
        z = zoo.build(name, scale="tiny")
        graph = capture(copy.deepcopy(z.model), z.inputs, name=f"{name}:tiny")
        both = args.home_computes
        profile = cost_profile(graph, ["cpu:0", "cpu:1"] if both else ["cpu:0"], stores=[] if both else ["cpu:1"])
        yield f"zoo:{name}:tiny", graph, profile, "cpu:0", "cpu:1"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--card", default="h200", choices=("h100", "h200"))
    ap.add_argument("--zoo", default="", help="comma-separated zoo models instead of GPT-2")
    ap.add_argument("--home-computes", action="store_true", help="zoo: the weights' home runs ops too")
    ap.add_argument("--methods", default="offload,checkpoint")
    ap.add_argument("--budgets", default="60,50,45", help="budgets of the compute device in %% of the eager peak")
    ap.add_argument("--limit", type=float, default=30.0, help="seconds per plan")
    args = ap.parse_args(argv)
    print("| case | method | budget | makespan | peak | copies home early / all | tail after the last compute | s |")
    print("|---|---|---|---|---|---|---|---|")
    for label, graph, profile, device, home in cases(args):
        homes = param_homes(graph, home)
        peak = eager_peak(graph)
        for method in args.methods.split(","):
            for pct in (int(b) for b in args.budgets.split(",")):
                row = f"| {label} | {method} | {pct}% |"
                print(row, plan_row(graph, profile, {device: peak * pct // 100}, [device, home], homes, method, args))
    return 0


def plan_row(graph, profile, budgets, devices, homes, method, args) -> str:
    """The plan's columns of the table, or its error."""
    t0 = time.perf_counter()
    try:
        plan = solve(graph, profile, budgets, devices, method, SolverOptions(time_limit_s=args.limit), homes)
    except XschedError as e:
        return f"{type(e).__name__}: {e.detail[:60]} | | | | |"
    s = time.perf_counter() - t0
    early, total, tail = home_copies(graph, plan, profile)
    peak = plan.predicted.peak_bytes[devices[0]]
    ms = plan.predicted.makespan_s * 1e3
    size = f"{peak / 2**30:.2f} GiB" if peak > 2**26 else f"{peak / 2**10:.1f} KiB"
    return f"{ms:.4g} ms | {size} | {early} / {total} | {tail * 1e3:.3g} ms | {s:.1f} |"


if __name__ == "__main__":
    raise SystemExit(main())
