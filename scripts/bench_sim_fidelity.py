"""The simulated H100 (`sim:h100-measured`, a roofline fitted to one profile) against what the H100 measured, op
class by op class, on the stored graphs and profiles of benchmarks/gpu/ (GPT-2 6 layers, b8, T1024, the loss whole
and in 8 row blocks; 2026-11-27). Nothing runs on a GPU: the measured column is the stored profile.

    python scripts/bench_sim_fidelity.py [--top 20]
    python scripts/bench_sim_fidelity.py --plans chunk8:35:held,whole:56:held --limit 30

`--plans`: each case's `auto` plan made on the model (the H100 as `sim:h100-measured`, the host as a store, a budget
in % of the whole loss's eager peak; `held`: the logits held, as `wrap` runs `loss.backward()`), then replayed on the
H100's measured profile: what a plan made on the model would take on the H100's own costs. Budgets are not checked
on the replay (the measured profile has workspaces the model does not). Run it under two checkouts to compare models.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections import defaultdict
from functools import cache
from pathlib import Path

from xsched.contracts.graph import Graph
from xsched.contracts.plan import Compute, Copy, Free, Plan, Step
from xsched.contracts.profile import Profile
from xsched.devices import get_device

ROOT = Path(__file__).resolve().parent.parent
GRAPHS = {"loss whole": "gpt2-full_n_layer6", "loss in 8 blocks": "gpt2-full_n_layer6-chunk8"}
CASE_GRAPHS = {"whole": "gpt2-full_n_layer6", "chunk8": "gpt2-full_n_layer6-chunk8"}
MODEL, GPU, STORE = "sim:h100-measured", "cuda:0", "cpu"


@cache
def load(stem: str) -> tuple[Graph, Profile]:
    base = ROOT / "benchmarks" / "gpu" / f"{stem}.h100-20261127"
    return Graph.load(f"{base}.graph.json.gz"), Profile.load(f"{base}.profile.json.gz")


def by_class(graph: Graph, profile: Profile) -> dict[str, tuple[int, float, float]]:
    """op target -> (ops, measured s, modelled s) over one step's ops, each once."""
    sim = get_device("sim:h100-measured")
    rows: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0])
    for op in graph.ops:
        row = rows[op.target]
        row[0] += 1
        row[1] += profile.op_cost(op.id, "cuda:0").time_s
        row[2] += sim.measure_op(graph, op).time_s
    return {t: (int(n), m, s) for t, (n, m, s) in rows.items()}


def measured_name(device: str) -> str:
    """The measured H100's name for the modelled one; any other device as it is."""
    return GPU if device == MODEL else device


def on_measured(step: Step) -> Step:
    """`step` with the modelled H100 renamed to the measured one."""
    if isinstance(step, Copy):
        return dataclasses.replace(step, src=measured_name(step.src), dst=measured_name(step.dst))
    if isinstance(step, (Compute, Free)):
        return dataclasses.replace(step, device=measured_name(step.device))
    return step


def plan_case(case: str, limit: float) -> str:
    """One `--plans` case as a table row: made on the model, replayed on the H100's measured profile."""
    from xsched.profiling.measure import profile_graph
    from xsched.simulate import simulate
    from xsched.solve import SolverOptions, eager_peak, eager_plan, solve
    from xsched.solve.autograd_boundary import forward_outputs

    name, pct, hold = case.split(":")
    graph, measured = load(CASE_GRAPHS[name])
    if hold == "held":
        graph = dataclasses.replace(
            graph, held_outputs=tuple(v for v in forward_outputs(graph) if graph.value[v].shape)
        )
    budget = eager_peak(load(CASE_GRAPHS["whole"])[0]) * int(pct) // 100
    model = profile_graph(graph, [MODEL], stores=[STORE], progress=False)
    plan = solve(
        graph, model, {MODEL: budget, STORE: 1 << 40}, [MODEL, STORE], options=SolverOptions(time_limit_s=limit)
    )
    modelled = plan.predicted.makespan_s / simulate(graph, eager_plan(graph, MODEL, model), model).makespan_s
    steps = tuple(on_measured(s) for s in plan.steps)
    budgets = {measured_name(d): b for d, b in plan.budgets.items()}
    homes = {v: measured_name(d) for v, d in plan.homes.items()}
    replay = Plan(**{**plan.__dict__, "steps": steps, "budgets": budgets, "homes": homes, "predicted": None})
    ran = simulate(graph, replay, measured, check_budgets=False).makespan_s
    eager = simulate(graph, eager_plan(graph, GPU, measured), measured).makespan_s
    return f"| {name}, {pct}%, {hold} | {modelled:.4f}x | {ran / eager:.4f}x |"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--top", type=int, default=20, help="op classes shown per graph, by measured time")
    ap.add_argument(
        "--plans", default="", help="cases graph:budget%%:held|free (graph whole or chunk8), comma-separated"
    )
    ap.add_argument("--limit", type=float, default=30.0, help="auto's time limit per --plans case, seconds")
    a = ap.parse_args(argv)
    os.chdir(ROOT)  # the measured spec lives in the checkout's devices/
    if a.plans:
        print("\n| case | on the model (vs its eager) | replayed on the H100's costs (vs measured eager) |")
        print("|---|---|---|")
        for case in a.plans.split(","):
            print(plan_case(case, a.limit), flush=True)
        return 0
    totals = {}
    for label, stem in GRAPHS.items():
        rows = by_class(*load(stem))
        measured, modelled = sum(r[1] for r in rows.values()), sum(r[2] for r in rows.values())
        totals[label] = (measured, modelled)
        print(
            f"\n{label}: {sum(r[0] for r in rows.values())} ops, sum of op times measured {measured * 1e3:.1f} ms, "
            f"modelled {modelled * 1e3:.1f} ms ({modelled / measured:.3f})"
        )
        print("\n| op | ops | measured ms | modelled ms | modelled / measured |\n|---|---|---|---|---|")
        for target, (n, m, s) in sorted(rows.items(), key=lambda kv: -kv[1][1])[: a.top]:
            print(f"| {target.removeprefix('aten.')} | {n} | {m * 1e3:.2f} | {s * 1e3:.2f} | {s / m:.2f} |")
    (mw, sw), (mb, sb) = totals.values()
    print(f"\nthe loss in 8 blocks against whole, summed op times: measured {mb / mw:.3f}, modelled {sb / sw:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
