"""Does `auto` keep its time limit? Wall time of `solve(method="auto")` against the limit, with each member's.

    python scripts/bench_auto_limit.py --cases mlp_mixer:75,unet:50,bn_mlp:60,bn_mlp:55 --limit 20

Each case is zoo-model:percent of its eager peak (scale "default", one modelled cuda:0: xsched.profiling.model's
roofline costs, so the run needs no GPU and is the same on any machine), or bn_mlp, four Linear-BatchNorm-ReLU blocks
(batch 512, width 64), the model on which the first GPU run found `auto` without a plan at 60%. Prints one row per
case: the wall time over the limit, who found the plan, and every member's time and outcome.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import torch
from torch import nn

from xsched import zoo
from xsched.capture.torch import capture
from xsched.contracts.graph import Graph
from xsched.errors import BudgetError
from xsched.profiling.model import cost_profile
from xsched.solve import registry
from xsched.solve.api import solve
from xsched.solve.options import SolverOptions

DEVICE = "cuda:0"


def bn_mlp() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(64, 64), nn.BatchNorm1d(64), nn.ReLU())])
    return model, (torch.randn(512, 64),)


def graph_of(name: str) -> Graph:
    if name == "bn_mlp":
        model, inputs = bn_mlp()
    else:
        z = zoo.build(name, scale="default")
        model, inputs = z.model, z.inputs
    return capture(model, inputs, name=name)


def timed_members(log: list[str]) -> dict[str, registry.SolverEntry]:
    """The registry with every entry's function wrapped to append 'name: seconds (limit) -> status' to `log`."""
    original = dict(registry.SOLVERS)
    for name, entry in original.items():

        def run(problem, options, warm=None, _fn=entry.fn, _name=name):  # noqa: ANN001, ANN202
            t0 = time.perf_counter()
            r = _fn(problem, options, warm)
            limit = f"{options.time_limit_s:.1f}" if options.time_limit_s is not None else "-"
            log.append(f"{_name} {time.perf_counter() - t0:.1f}/{limit} s {r.status}")
            return r

        registry.SOLVERS[name] = dataclasses.replace(entry, fn=run)
    return original


def run_case(name: str, percent: int, limit: float) -> str:
    graph = graph_of(name)
    profile = cost_profile(graph, [DEVICE])
    log: list[str] = []
    original = timed_members(log)
    t0 = time.perf_counter()
    try:
        plan = solve(graph, profile, {DEVICE: f"{percent}%"}, [DEVICE], "auto", SolverOptions(time_limit_s=limit))
        found = f"{plan.solver.found_by} ({plan.solver.status})"
    except BudgetError as e:
        found = "no plan: " + e.detail.split(";")[0].split(" (")[0]
    finally:
        registry.SOLVERS.update(original)
    wall = time.perf_counter() - t0
    members = ", ".join(m for m in log if not m.endswith(" failed") and not m.startswith(("eager ", "greedy ")))
    return f"| {name} | {len(graph.ops)} | {percent}% | {wall:.1f} s | {wall / limit:.2f} | {found} | {members} |"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="mlp_mixer:75,unet:50,bn_mlp:60,bn_mlp:55")
    ap.add_argument("--limit", type=float, default=20.0, help="auto's time limit per case, seconds")
    a = ap.parse_args()
    rows = [
        "| model | ops | budget | auto's wall time | over the limit | found by | members: seconds/limit, outcome |",
        "|---|---|---|---|---|---|---|",
    ]
    for case in a.cases.split(","):
        name, _, pct = case.partition(":")
        rows.append(run_case(name, int(pct), a.limit))
        print(rows[-1], flush=True)
    print("\n".join(["", f"auto with time_limit_s={a.limit:g} on a modelled {DEVICE}", "", *rows]))


if __name__ == "__main__":
    main()
