"""A forward output parked on the store instead of computed again at the end: GPT-2 (6 layers, batch 8, T1024) with
its op costs measured on an NVIDIA H100 (benchmarks/gpu/) and the host as a store over the measured link, planned
by the `park` heuristic at budgets in % of the eager peak. For each plan that runs a forward output's producer again
at the end, the same plan with that output parked instead (copied out right after it is made, freed on the GPU
where the plan freed it, and either left on the store or copied back to the GPU at the end, where wrap's user
expects it), each replayed by the simulator under the budgets: predicted makespans, no GPU runs.

    python scripts/bench_park_outputs.py --budgets 42,45,48,51
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

from xsched.contracts.graph import Graph
from xsched.contracts.plan import Compute, Copy, Plan, Step, autograd_boundary
from xsched.contracts.profile import Profile
from xsched.errors import XschedError
from xsched.simulate import simulate
from xsched.solve import solve
from xsched.solve.autograd_boundary import forward_outputs
from xsched.solve.reference import eager_plan

DATA = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu"
GPU, HOST = "cuda:0", "cpu"


def load() -> tuple[Graph, Profile]:
    graph = Graph.load(DATA / "gpt2-full_n_layer6.graph.json.gz")
    return graph, Profile.load(DATA / "gpt2-full_n_layer6.h100.profile.json.gz")


def end_reruns(graph: Graph, plan: Plan) -> list[tuple[str, int, int]]:
    """(forward output, index of its first compute, index of the rerun after the last step of backward that
    reads anything else) for each forward output whose producer runs again as the plan's last computes."""
    first: dict[str, int] = {}
    last: dict[str, int] = {}
    for i, s in enumerate(plan.steps):
        if isinstance(s, Compute):
            first.setdefault(s.op, i)
            last[s.op] = i
    out = []
    for v in forward_outputs(graph):
        op = graph.producer[v]
        if last[op] != first[op] and last[op] > (plan.boundary or 0):
            out.append((v, first[op], last[op]))
    return out


def parked(graph: Graph, plan: Plan, v: str, made: int, rerun: int, deliver: bool) -> Plan:
    """The plan with `v` copied out right after `made` instead of made again at `rerun`; copied back at the end
    when `deliver`."""
    steps: list[Step | None] = list(plan.steps)
    steps[rerun] = None
    steps.insert(made + 1, Copy(v, GPU, HOST))
    body = [s for s in steps if s is not None] + ([Copy(v, HOST, GPU)] if deliver else [])
    return replace(plan, steps=tuple(body), boundary=autograd_boundary(graph, body), predicted=None)


def makespan(graph: Graph, plan: Plan, profile: Profile) -> float | str:
    try:
        return simulate(graph, plan, profile, check_budgets=True).makespan_s
    except XschedError as e:
        return e.detail.split(";")[0]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--budgets", default="42,45,48,51", help="GPU budgets in %% of the eager peak")
    a = ap.parse_args(argv)
    graph, profile = load()
    eager_s = eager_plan(graph, GPU, profile).predicted.time_s
    print(f"eager step (predicted) {eager_s * 1e3:.1f} ms")
    print("\n| budget | park plan | its end reruns | parked, left on the store | parked, copied back at the end |")
    print("|---|---|---|---|---|")
    for pct in (int(x) for x in a.budgets.split(",")):
        plan = solve(graph, profile, {GPU: f"{pct}%", HOST: 1 << 40}, [GPU, HOST], "park")
        base = plan.predicted.makespan_s
        reruns = end_reruns(graph, plan)
        cells = []
        for deliver in (False, True):
            alt = plan
            while rest := end_reruns(graph, alt):  # one at a time: each change moves the later steps' indices
                alt = parked(graph, alt, *rest[0], deliver)
            got = makespan(graph, alt, profile) if reruns else "-"
            cells.append(f"{got / eager_s:.4f}x" if isinstance(got, float) else got)
        what = ", ".join(f"{v} ({profile.op_cost(graph.producer[v], GPU).time_s * 1e3:.1f} ms)" for v, _, _ in reruns)
        print(f"| {pct}% | {base / eager_s:.4f}x | {what or 'none'} | {cells[0]} | {cells[1]} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
