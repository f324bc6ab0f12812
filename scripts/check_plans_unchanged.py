"""Record the steps of the plans that the heuristics and the deterministic searches give on the benchmark graphs, and
compare two such records: a refactoring of the solvers must leave every plan the same (issue 33, "Done when").

    python scripts/check_plans_unchanged.py record OUT.json [--quick] [--only bench|zoo|gpu] [--zoo-percents 90,70]
        [--methods hier,park]
    python scripts/check_plans_unchanged.py compare BEFORE.json AFTER.json

Cases: every graph of benchmarks/graphs/ on its one device at 90/70/50% of the eager peak; every zoo model at scale
tiny, captured, with modelled costs on cpu:0 and cpu:1 as a store, at 90/70% (`--zoo-percents`); GPT-2 (benchmarks/gpu, H200 costs)
with the host as a 57 GB/s store at 60/45%. Methods: every heuristic alone, and the searches that end on their own
before the time limit (`park-search`, not on GPT-2, where it runs until the limit; the stage MILP on graphs up to
60 ops x devices). `order-gaps` is left out: it gives each order 10 ms, so its plans depend on the machine's load. A plan is
recorded as the SHA-1 of its steps (JSON), its step count and predicted makespan; a method without a plan as its
error. `--quick`: two graphs, two zoo models, no GPT-2 (for the test that runs this script). `--methods`: these methods
instead; `hier` runs with deterministic stops (no leaf MILP, H-ILPs stopped by a node limit, no refinement, one
process), so its plans do not depend on the machine's load.

Only the public API is used (`xsched.solve`, `eager_peak`, the importers and the zoo), so one script runs on the
commit before and after.
"""

from __future__ import annotations

import argparse
import copy
import gzip
import hashlib
import json
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import replace
from pathlib import Path

from xsched import zoo
from xsched.capture.torch import capture
from xsched.contracts.graph import Graph
from xsched.contracts.profile import DeviceInfo, LinkCost, Profile
from xsched.errors import XschedError
from xsched.importers import BENCH_DEVICE, import_networkx
from xsched.profiling.model import cost_profile
from xsched.solve import SolverOptions, eager_peak, solve
from xsched.solve.hier import HierSettings, solve_hier
from xsched.solve.problem import Problem

ROOT = Path(__file__).resolve().parents[1]
HEURISTICS = ("eager", "greedy", "fastest", "sqrt", "checkpoint", "offload", "gaps", "park")
SEARCHES = ("park-search",)
MILP_MAX_SIZE = 60  # ops x devices: the registry's own threshold for the stage MILP inside auto
TIME_LIMIT_S = 60.0  # the searches end by themselves well before this on these graphs (checked: status recorded)
HIER_NODES = 200  # hier's H-ILPs stop at this many nodes, long before the clock (as tests/test_hier.py's determinism)


Case = tuple[str, Graph, Profile, dict[str, int], tuple[str, ...]]


def cases(quick: bool, only: str | None = None, zoo_percents: tuple[int, ...] = (90, 70)) -> Iterator[Case]:
    graphs = sorted((ROOT / "benchmarks" / "graphs").glob("*.json"))
    for path in (graphs[:2] if quick else graphs) if only in (None, "bench") else ():
        g, prof = import_networkx(path)
        peak = eager_peak(g)
        for pct in (90, 70, 50):
            yield f"{path.stem}@{pct}%", g, prof, {BENCH_DEVICE: peak * pct // 100}, (BENCH_DEVICE,)
    for name in (("gpt2", "mlp_mixer") if quick else zoo.names()) if only in (None, "zoo") else ():
        z = zoo.build(name, scale="tiny")
        g = capture(copy.deepcopy(z.model), z.inputs, name=f"{name}:tiny")
        prof = cost_profile(g, ["cpu:0"], stores=["cpu:1"])
        peak = eager_peak(g)
        for pct in zoo_percents:
            yield f"zoo:{name}:tiny@{pct}%", g, prof, {"cpu:0": peak * pct // 100}, ("cpu:0", "cpu:1")
    if not quick and only in (None, "gpu"):
        g, prof = gpt2_gpu()
        peak = eager_peak(g)
        for pct in (60, 45):
            yield f"gpt2-gpu-h200+host@{pct}%", g, prof, {"cuda:0": peak * pct // 100}, ("cuda:0", "cpu")


def gpt2_gpu() -> tuple[Graph, Profile]:
    """benchmarks/gpu's GPT-2 with its H200 costs, the host as a store over a 57 GB/s link each way."""

    def read(name: str) -> dict:
        with gzip.open(ROOT / "benchmarks" / "gpu" / name, "rt") as f:
            return json.load(f)

    g = Graph.from_dict(read("gpt2-full_n_layer6.graph.json.gz"))
    prof = Profile.from_dict(read("gpt2-full_n_layer6.h200.profile.json.gz"))
    link = LinkCost(5e-6, 57e9)
    devices = {**prof.devices, "cpu": DeviceInfo("cpu", "host", 1 << 40)}
    return g, replace(prof, devices=devices, copy={"cuda:0->cpu": link, "cpu->cuda:0": link})


def record_one(g: Graph, prof: Profile, budgets: Mapping[str, int], devices: tuple[str, ...], method: str) -> dict:
    t0 = time.perf_counter()
    try:
        if method == "hier":
            plan = deterministic_hier(g, prof, budgets, devices)
        else:
            plan = solve(g, prof, budgets, devices, method, SolverOptions(time_limit_s=TIME_LIMIT_S))
    except XschedError as e:
        return {"error": f"{type(e).__name__}: {e.detail}", "s": round(time.perf_counter() - t0, 2)}
    steps = json.dumps(plan.to_dict()["steps"], sort_keys=True)
    return {
        "steps": hashlib.sha1(steps.encode()).hexdigest(),
        "n": len(plan.steps),
        "makespan_s": plan.predicted.makespan_s if plan.predicted else None,
        "status": plan.solver.status,
        "s": round(time.perf_counter() - t0, 2),
    }


def deterministic_hier(g: Graph, prof: Profile, budgets: Mapping[str, int], devices: tuple[str, ...]):
    """hier's plan with stops that do not depend on the clock: heuristic leaves, H-ILPs to a node limit."""
    homes = {v: devices[0] for v in g.inputs}
    opts = SolverOptions(time_limit_s=TIME_LIMIT_S * 10, node_limit=HIER_NODES, hier_processes=1, hier_refine=False)
    settings = HierSettings(leaf_s=0, region_s=TIME_LIMIT_S * 10, refine=False)
    return solve_hier(Problem(g, prof, dict(budgets), list(devices), homes), opts, settings=settings)


def record(
    out: Path,
    quick: bool,
    only: str | None = None,
    zoo_percents: tuple[int, ...] = (90, 70),
    only_methods: tuple[str, ...] = (),
) -> None:
    rows: dict[str, dict] = {}
    for label, g, prof, budgets, devices in cases(quick, only, zoo_percents):
        size = len(g.ops) * len(devices)
        searches = SEARCHES if not label.startswith("gpt2-gpu") else ()
        methods = only_methods or (*HEURISTICS, *searches, *(("milp",) if size <= MILP_MAX_SIZE else ()))
        for m in methods:
            rows[f"{label} {m}"] = r = record_one(g, prof, budgets, devices, m)
            print(f"{label} {m}: {r.get('steps', r.get('error'))[:60]} ({r['s']} s)", flush=True)
    out.write_text(json.dumps(rows, indent=1, sort_keys=True) + "\n")


def compare(before: Path, after: Path) -> int:
    """Print every case whose plan changed (or that one record lacks); 1 if any did."""
    a, b = json.loads(before.read_text()), json.loads(after.read_text())
    changed = 0
    for key in sorted(a.keys() | b.keys()):
        x, y = a.get(key), b.get(key)
        same = x is not None and y is not None and x.get("steps") == y.get("steps") and x.get("error") == y.get("error")
        if not same:
            changed += 1
            print(f"CHANGED {key}:\n  before {x}\n  after  {y}")
    plans = sum("steps" in x for x in a.values())
    print(f"{len(a)} cases ({plans} with a plan), {changed} changed")
    return 1 if changed else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record")
    r.add_argument("out", type=Path)
    r.add_argument("--quick", action="store_true")
    r.add_argument("--only", choices=("bench", "zoo", "gpu"))
    r.add_argument("--zoo-percents", default="90,70", help="budgets of the zoo cases, in %% of the eager peak")
    r.add_argument("--methods", default="", help="comma-separated methods instead of the default set (e.g. hier)")
    c = sub.add_parser("compare")
    c.add_argument("before", type=Path)
    c.add_argument("after", type=Path)
    args = p.parse_args(argv)
    if args.cmd == "record":
        methods = tuple(m for m in args.methods.split(",") if m)
        record(args.out, args.quick, args.only, tuple(int(x) for x in args.zoo_percents.split(",")), methods)
        return 0
    return compare(args.before, args.after)


if __name__ == "__main__":
    sys.exit(main())
