"""Benchmark the solver on the published rematerialization graphs (Checkmate / Moccasin) at fractions of the eager peak.

For each graph and budget: TDI of the returned plan (sequential time / eager time - 1, in %), TDI of the MILP's own
objective, solve / Pyomo build / HiGHS times, the simulator-validated peak, and the published numbers beside them.

    python scripts/bench_solver.py --time-limit 60 --budgets 0.9,0.8 [--graphs random_layered_n100,...] [--out FILE]
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from xsched.errors import BudgetError, XschedError
from xsched.graph import Graph
from xsched.importers import BENCH_DEVICE, import_networkx
from xsched.profile import Profile
from xsched.simulate import simulate
from xsched.solve.api import METHODS, solve
from xsched.solve.eager import eager_peak, eager_plan
from xsched.solve.options import SolverOptions

BENCH_DIR = Path(__file__).resolve().parents[1] / "benchmarks" / "graphs"


def published(readme: Path) -> dict[str, list[str]]:
    """graph -> its rows of the README's results table, in order (90% then 80%): 'M; Checkmate; Moccasin'."""
    rows: dict[str, list[str]] = {}
    if not readme.exists():
        return rows
    for line in readme.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 5 and re.fullmatch(r"[a-z0-9_]+", cells[0]) and cells[0] != "graph":
            rows.setdefault(cells[0], []).append(f"M {cells[2]}; Checkmate {cells[3]}; Moccasin {cells[4]}")
    return rows


def fmt_budget(b: int) -> str:
    # The README's "GB" for the Checkmate graphs are 2^30 bytes: 90% of our eager peaks reproduce its M values in GiB.
    return f"{b / 2**30:.1f} GiB" if b >= 10**7 else f"{b:,}"


def run_one(graph: Graph, profile: Profile, frac: float, args: argparse.Namespace) -> dict[str, Any]:
    """Solve one (graph, budget) and measure the plan against the eager plan."""
    eager_time = eager_plan(graph, BENCH_DEVICE, profile).predicted.time_s
    budget = int(eager_peak(graph) * frac)
    row: dict[str, Any] = {"graph": graph.name, "n": len(graph.ops), "frac": frac, "M": budget}
    t0 = time.perf_counter()
    try:
        if args.heuristics_only:
            plans = []
            for m in METHODS[1:]:
                try:
                    plans.append(solve(graph, profile, {BENCH_DEVICE: budget}, method=m))
                except BudgetError:
                    pass
            if not plans:
                raise BudgetError("no heuristic meets the budget", stage="bench")
            plan = min(plans, key=lambda p: p.predicted.time_s)
        else:
            options = SolverOptions(time_limit_s=args.time_limit, threads=args.threads)
            plan = solve(graph, profile, {BENCH_DEVICE: budget}, method="milp", options=options)
    except BudgetError as e:  # proven: by the lower bounds before solving, or by the MILP
        note = e.detail.split(": ")[0] + (f" (set by op {e.op})" if e.op else "")
        row.update(status="infeasible", note=note, wall_s=time.perf_counter() - t0)
        return row
    except XschedError as e:  # NoIncumbent: neither the MILP nor a heuristic found a plan; nothing is proven
        row.update(status="no plan", note=e.detail.split(", and")[0], wall_s=time.perf_counter() - t0)
        return row
    wall = time.perf_counter() - t0
    sim = simulate(graph, plan, profile)  # the plan is re-validated here, budgets included
    s = plan.solver
    objective = s.extra.get("milp_objective")
    row.update(
        method=s.method,
        status=s.status,
        gap=s.gap,
        tdi=100 * (sim.time_s / eager_time - 1),
        milp_tdi=100 * (objective / eager_time - 1) if objective is not None else None,
        solve_s=s.solve_s,
        wall_s=wall,
        build_s=s.extra.get("build_s"),
        handoff_s=s.extra.get("handoff_s"),
        highs_s=s.extra.get("highs_s"),
        peak=sim.peak_bytes[BENCH_DEVICE],
        recomputes=sim.computes - len(graph.ops),
        warm=s.extra.get("warm_start"),
        warm_tdi=100 * (s.extra["warm_start_time_s"] / eager_time - 1) if s.extra.get("warm_start_time_s") else None,
        note=s.extra.get("reason", ""),
    )
    return row


def _f(x: float | None, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def table(rows: Sequence[dict[str, Any]], pub: dict[str, list[str]], fracs: Sequence[float]) -> str:
    head = (
        "| graph | n | budget | M | method / status | TDI % | MILP obj TDI % | gap | warm start TDI % | recomputes "
        "| solve s | build s | handoff s | HiGHS s | validated peak (of M) | published (Moccasin paper) |"
    )
    out = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        k = fracs.index(r["frac"]) if r["frac"] in fracs else 99
        ref = pub.get(r["graph"], [])
        ref_text = ref[k] if k < len(ref) else "-"
        budget = f"{r['frac']:.0%}"
        if r["status"] in ("infeasible", "no plan"):
            out.append(
                f"| {r['graph']} | {r['n']} | {budget} | {fmt_budget(r['M'])} | {r['status']}: {r['note']} "
                f"| - | - | - | - | - | {r['wall_s']:.1f} | - | - | - | - | {ref_text} |"
            )
            continue
        status = r["status"] + (f" ({r['note'][:60]})" if r["note"] else "")
        out.append(
            f"| {r['graph']} | {r['n']} | {budget} | {fmt_budget(r['M'])} | {r['method']} / {status} | {_f(r['tdi'])} "
            f"| {_f(r['milp_tdi'])} | {_f(r['gap'], '.2%')} | {_f(r['warm_tdi'])} | {r['recomputes']} | {r['solve_s']:.1f} "
            f"| {_f(r['build_s'], '.1f')} | {_f(r['handoff_s'], '.1f')} | {_f(r['highs_s'], '.1f')} | {fmt_budget(r['peak'])} ({r['peak'] / r['M']:.1%}) "
            f"| {ref_text} |"
        )
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", type=Path, default=BENCH_DIR, help="folder of node-link graphs and their README")
    p.add_argument("--graphs", default="", help="comma-separated graph names (file stems); default all")
    p.add_argument("--budgets", default="0.9,0.8", help="fractions of each graph's eager peak")
    p.add_argument("--time-limit", type=float, default=60.0, help="MILP time limit per solve, seconds")
    p.add_argument("--threads", type=int, default=None, help="HiGHS threads")
    p.add_argument("--heuristics-only", action="store_true", help="best heuristic plan instead of the MILP")
    p.add_argument("--out", type=Path, help="also write the markdown table here")
    args = p.parse_args(argv)
    fracs = [float(x) for x in args.budgets.split(",")]
    names = [n for n in args.graphs.split(",") if n]
    paths = [args.dir / f"{n}.json" for n in names] if names else sorted(args.dir.glob("*.json"))
    pub = published(args.dir / "README.md")
    rows = []
    for path in paths:
        graph, profile = import_networkx(path)
        # named by the file stem, as in the README; the fingerprint (and so the profile) ignores the name
        graph = Graph(path.stem, graph.values, graph.ops, graph.outputs, graph.extra)
        for frac in fracs:
            row = run_one(graph, profile, frac, args)
            rows.append(row)
            print(
                f"{path.stem} {frac:.0%}: {row.get('status')} TDI {_f(row.get('tdi'))} % in {row['wall_s']:.1f} s",
                file=sys.stderr,
                flush=True,
            )
    text = table(rows, pub, fracs)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
