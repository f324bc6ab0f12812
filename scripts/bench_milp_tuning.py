"""Time and quality of the flat MILP on the published benchmark graphs: one row per (graph, budget, warm/cold).

Each row runs solve_milp once (warm: from the heuristics' best plan, method "heuristics", whose time counts in the total) and reports the
plan's TDI (sequential time / eager time - 1, in %), the MILP objective's and bound's TDI, the wall time split into
heuristics, Pyomo build, hand-off to HiGHS and search (extraction included in the total), and whether the issue's
targets hold: random_layered_n100 at 80% with plan TDI <= 2.3% in <= 30 s total, checkmate_fcn_8_vgg_train at 80%
in <= 10 s. It runs whatever `xsched` is importable, so the same script measures an older copy of the solver with
PYTHONPATH pointing at it.

    python scripts/bench_milp_tuning.py [--time-limit 30] [--cases random_layered_n100:0.8:warm,...] [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

import xsched
from xsched.errors import BudgetError, NoIncumbent
from xsched.importers import BENCH_DEVICE, import_networkx
from xsched.simulate import simulate
from xsched.solve.api import solve
from xsched.solve.milp.milp import solve_milp
from xsched.solve.options import SolverOptions
from xsched.solve.problem import Problem
from xsched.solve.reference import eager_peak, eager_plan

BENCH_DIR = Path(__file__).resolve().parents[1] / "benchmarks" / "graphs"
CASES = (
    "random_layered_n100:0.9:warm",
    "random_layered_n100:0.9:cold",
    "random_layered_n100:0.8:warm",
    "random_layered_n100:0.8:cold",
    "checkmate_fcn_8_vgg_train:0.8:warm",
    "checkmate_fcn_8_vgg_train:0.8:cold",
)
TARGETS = {("random_layered_n100", 0.8): (2.3, 30.0), ("checkmate_fcn_8_vgg_train", 0.8): (None, 10.0)}


def run_case(name: str, frac: float, warm: bool, time_limit: float) -> dict:
    """One solve; every number comes from the returned plan, re-checked by the simulator."""
    graph, profile = import_networkx(BENCH_DIR / f"{name}.json")
    eager_time = eager_plan(graph, BENCH_DEVICE, profile).predicted.time_s
    budgets = {BENCH_DEVICE: int(eager_peak(graph) * frac)}
    tdi = lambda x: None if x is None else 100 * (x / eager_time - 1)  # noqa: E731
    t0 = time.perf_counter()
    try:  # the heuristics' best plan, None when none fits
        start = solve(graph, profile, budgets, [BENCH_DEVICE], "heuristics", homes={}) if warm else None
    except BudgetError:
        start = None
    heuristics_s = time.perf_counter() - t0
    try:
        plan = solve_milp(
            Problem(graph, profile, budgets, [BENCH_DEVICE], {}),
            SolverOptions(time_limit_s=time_limit),
            warm_start=start,
        )
    except NoIncumbent as e:
        return {"case": f"{name} {frac:.0%} {'warm' if warm else 'cold'}", "note": str(e)}
    total = time.perf_counter() - t0
    sim = simulate(graph, plan, profile)
    e = plan.solver.stats
    at = e.incumbent_s
    best = e.best_incumbent
    row = {
        "case": f"{name} {frac:.0%} {'warm' if warm else 'cold'}",
        "plan_tdi": tdi(sim.time_s),
        "start_tdi": tdi(start.predicted.time_s) if start is not None else None,
        "obj_tdi": tdi(e.model_objective),
        "bound_tdi": tdi(e.model_bound),
        "status": plan.solver.status,
        "total_s": total,
        "heur_s": heuristics_s,
        "build_s": plan.solver.times.build_s,
        "handoff_s": e.handoff_s,
        "highs_s": plan.solver.times.solve_s,
        "best_at_s": heuristics_s + at[best] if at and best is not None and best >= 0 else None,
        "size": f"{e.n_binaries} / {e.n_constraints}",
    }
    want_tdi, want_s = TARGETS.get((name, frac), (None, None))
    if want_s is not None:
        ok = total <= want_s and (want_tdi is None or row["plan_tdi"] <= want_tdi)
        row["target"] = (
            f"{'met' if ok else 'MISSED'} (TDI <= {want_tdi}%, " if want_tdi else f"{'met' if ok else 'MISSED'} ("
        )
        row["target"] += f"<= {want_s:.0f} s)"
    return row


COLUMNS = (
    ("case", "case", "{}"),
    ("plan TDI %", "plan_tdi", "{:.3f}"),
    ("warm start TDI %", "start_tdi", "{:.3f}"),
    ("objective TDI %", "obj_tdi", "{:.3f}"),
    ("bound TDI %", "bound_tdi", "{:.3f}"),
    ("status", "status", "{}"),
    ("total s", "total_s", "{:.1f}"),
    ("heuristics s", "heur_s", "{:.2f}"),
    ("build s", "build_s", "{:.2f}"),
    ("hand-off s", "handoff_s", "{:.2f}"),
    ("HiGHS s", "highs_s", "{:.1f}"),
    ("best plan found at s", "best_at_s", "{:.1f}"),
    ("binaries / constraints", "size", "{}"),
    ("target", "target", "{}"),
)


def cell(row: dict, key: str, fmt: str) -> str:
    x = row.get(key)
    return "-" if x is None else fmt.format(x)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--time-limit", type=float, default=30.0, help="SolverOptions.time_limit_s of every solve")
    ap.add_argument("--cases", default=",".join(CASES), help="graph:fraction:warm|cold, comma-separated")
    ap.add_argument("--out", type=Path, help="append the table to this file too")
    args = ap.parse_args(argv)
    lines = [
        f"xsched from {Path(xsched.__file__).parent}; {platform.node()}, {os.cpu_count()} CPUs, "
        f"load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}; time limit {args.time_limit:g} s; "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        "",
        "| " + " | ".join(c[0] for c in COLUMNS) + " |",
        "|" + "---|" * len(COLUMNS),
    ]
    print("\n".join(lines), flush=True)
    for case in args.cases.split(","):
        name, frac, mode = case.split(":")
        row = run_case(name, float(frac), mode == "warm", args.time_limit)
        line = "| " + " | ".join(cell(row, key, fmt) for _, key, fmt in COLUMNS) + " |"
        if "note" in row:
            line += f" {row['note']}"
        lines.append(line)
        print(line, flush=True)
    if args.out:
        with args.out.open("a") as f:
            f.write("\n".join(lines) + "\n\n")


if __name__ == "__main__":
    sys.exit(main())
