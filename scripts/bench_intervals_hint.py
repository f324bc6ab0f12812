"""The interval model from a heuristic's plan: GPT-2 (6 layers, batch 8, T1024) with its op costs measured on an
NVIDIA H100 (benchmarks/gpu/), at GPU budgets in % of the eager peak, the host as a store or the GPU alone. For each:
the heuristic's plan (park with the store, gaps alone), intervals-cpsat from scratch, intervals-cpsat with that plan
as its warm start (a complete hint), and auto; predicted makespans (the simulator), no GPU runs. "model / simulated":
the interval model's own time of the plan it returned against the simulator's makespan of that plan.

    python scripts/bench_intervals_hint.py --cases 45:store,55:store,55:gpu --limit 60 --workers 2
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path

from xsched.contracts.graph import Graph
from xsched.contracts.plan import Plan
from xsched.contracts.profile import Profile
from xsched.errors import XschedError
from xsched.solve import solve
from xsched.solve.intervals import solve_intervals
from xsched.solve.options import SolverOptions
from xsched.solve.problem import Problem

DATA = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu"
GPU, HOST = "cuda:0", "cpu"


def timed(run: Callable[..., Plan], *args: object, **kwargs: object) -> tuple[str, str]:
    """'makespan (method, status, seconds)' of run(*args, **kwargs), or why there is no plan; and 'model / simulated':
    the interval model's own time of that plan over the simulator's makespan ('-' for other methods)."""
    t0 = time.perf_counter()
    try:
        plan = run(*args, **kwargs)
    except XschedError as e:
        return f"none ({e.detail.split(';')[0][:60]}, {time.perf_counter() - t0:.0f} s)", "-"
    info, span = plan.solver, plan.predicted.makespan_s
    model = getattr(info.stats, "model_objective", None)
    ratio = f"{model * 1e3:.1f} / {span * 1e3:.1f} ms = {model / span:.3f}" if model is not None else "-"
    return f"{span * 1e3:.1f} ms ({info.method}, {info.status}, {time.perf_counter() - t0:.0f} s)", ratio


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default="45:store,55:store,55:gpu", help="PCT:store or PCT:gpu, comma-separated")
    ap.add_argument("--limit", type=float, default=60.0, help="seconds per solve")
    ap.add_argument("--workers", type=int, default=2, help="CP-SAT workers and solver threads")
    a = ap.parse_args(argv)
    graph = Graph.load(DATA / "gpt2-full_n_layer6.graph.json.gz")
    profile = Profile.load(DATA / "gpt2-full_n_layer6.h100.profile.json.gz")
    options = SolverOptions(time_limit_s=a.limit, solver_threads=a.workers)
    print(
        "| GPU budget | heuristic | its plan | intervals-cpsat alone | model / simulated | from the heuristic's plan "
        "| model / simulated | auto |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for case in a.cases.split(","):
        pct, where = case.split(":")
        budgets = {GPU: f"{pct}%", **({HOST: "64GiB"} if where == "store" else {})}
        devices = [GPU, HOST] if where == "store" else [GPU]
        problem = Problem.make(graph, profile, budgets, devices)
        heuristic = "park" if where == "store" else "gaps"
        warm = solve(graph, profile, budgets, devices, heuristic)
        row = [
            f"{pct}%, {'host store' if where == 'store' else 'GPU alone'}",
            heuristic,
            f"{warm.predicted.makespan_s * 1e3:.1f} ms",
            *timed(solve_intervals, problem, options, workers=a.workers),
            *timed(solve_intervals, problem, options, warm, workers=a.workers),
            timed(solve, graph, profile, budgets, devices, "auto", options)[0],
        ]
        print("| " + " | ".join(row) + " |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
