"""Does `solve` keep its time limit? Wall time of `auto` over the limit on every graph of benchmarks/graphs/ and on
GPT-2's GPU graph (benchmarks/gpu/: the H200 profile with the host as a store over a 57 GB/s link, and the H100
profile, which holds the host store's measured links), for each limit given.

    python scripts/bench_time_limit.py --limits 1,2,5,10,30,60
    python scripts/bench_time_limit.py --cases gpt2-h100 --limits 2

The target (issue 33): every run returns within limit x 1.1 + 1 s, with the best plan so far and its gap. Prints one
markdown row per case and limit: wall time, wall / limit, whether it kept the target, who found the plan, its
status and gap. `--cases` picks cases by name prefix; `--quick` is the reduced mode the tests run (one small graph,
limits of 0.5 s).
"""

from __future__ import annotations

import argparse
import gzip
import json
import time
from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path

from xsched.contracts.graph import Graph
from xsched.contracts.profile import DeviceInfo, LinkCost, Profile
from xsched.errors import XschedError
from xsched.importers import BENCH_DEVICE, import_networkx
from xsched.solve.api import solve_result
from xsched.solve.options import SolverOptions

ROOT = Path(__file__).resolve().parents[1]
GRAPHS, GPU_DATA = ROOT / "benchmarks" / "graphs", ROOT / "benchmarks" / "gpu"
GPU, HOST = "cuda:0", "cpu"
HOST_LINK = LinkCost(5e-6, 57e9)  # the H200's measured host link, 3.6-6.8 us + 57 GB/s (benchmarks/gpu/README.md)
GRAPH_BUDGETS = ("80%",)  # of the eager peak, on the one device of a benchmark graph
GPU_BUDGETS = ("56%", "45%")  # of GPT-2's eager peak on cuda:0; the host store 64 GiB


def _read(name: str) -> dict:
    with gzip.open(GPU_DATA / name, "rt") as f:
        return json.load(f)


def cases() -> Iterator[tuple[str, Graph, Profile, dict[str, str]]]:
    """(name, graph, profile, budgets) of every case, lazily: a case is loaded only when asked for."""
    for path in sorted(GRAPHS.glob("*.json")):
        for budget in GRAPH_BUDGETS:
            yield path.stem, *import_networkx(path), {BENCH_DEVICE: budget}
    graph = Graph.from_dict(_read("gpt2-full_n_layer6.graph.json.gz"))
    h200 = Profile.from_dict(_read("gpt2-full_n_layer6.h200.profile.json.gz"))
    h200 = replace(
        h200,
        devices={**h200.devices, HOST: DeviceInfo("cpu", "host", 1 << 40)},
        copy={f"{GPU}->{HOST}": HOST_LINK, f"{HOST}->{GPU}": HOST_LINK},
    )
    h100 = Profile.from_dict(_read("gpt2-full_n_layer6.h100.profile.json.gz"))
    for name, profile in (("gpt2-h200", h200), ("gpt2-h100", h100)):
        for budget in GPU_BUDGETS:
            yield name, graph, profile, {GPU: budget, HOST: "64GiB"}


def run_case(name: str, graph: Graph, profile: Profile, budgets: dict[str, str], limit: float) -> dict:
    """One `auto` run: its wall time and what it returned."""
    t0 = time.perf_counter()
    try:
        out = solve_result(graph, profile, budgets, method="auto", options=SolverOptions(time_limit_s=limit))
        r = out.record
        found = f"{r.stats.found_by} ({r.status})" if out.plan is not None else f"no plan ({r.status})"
        gap = r.gap
    except XschedError as e:
        found, gap = f"no plan: {e.detail[:60]}", None
    wall = time.perf_counter() - t0
    budget = ", ".join(f"{d} {b}" for d, b in budgets.items())
    return {"case": name, "budget": budget, "limit": limit, "wall": wall, "found": found, "gap": gap}


def row(r: dict) -> str:
    kept = "yes" if r["wall"] <= r["limit"] * 1.1 + 1.0 else "**no**"
    gap = f"{r['gap']:.3f}" if r["gap"] is not None else "-"
    return (
        f"| {r['case']} | {r['budget']} | {r['limit']:g} | {r['wall']:.2f} | {r['wall'] / r['limit']:.2f} | {kept} "
        f"| {r['found']} | {gap} |"
    )


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--limits", default="1,2,5", help="time limits in seconds, comma-separated")
    ap.add_argument("--cases", default="", help="comma-separated name prefixes (default: every case)")
    ap.add_argument("--quick", action="store_true", help="reduced mode: one small graph, 0.5 s")
    a = ap.parse_args(argv)
    limits = [0.5] if a.quick else [float(x) for x in a.limits.split(",")]
    prefixes = ("random_layered_n100",) if a.quick else tuple(p for p in a.cases.split(",") if p)
    print("| case | budget | limit s | wall s | wall / limit | within limit x 1.1 + 1 s | found by | gap |")
    print("|---|---|---|---|---|---|---|---|")
    worst = 0.0
    for name, graph, profile, budgets in cases():
        if prefixes and not name.startswith(prefixes):
            continue
        for limit in limits:
            r = run_case(name, graph, profile, budgets, limit)
            worst = max(worst, r["wall"] - (limit * 1.1 + 1.0))
            print(row(r), flush=True)
    return 0 if worst <= 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
