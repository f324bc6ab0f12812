"""issue 9's solver comparison (run through `scripts/bench_solver.py --compare`): every formulation / backend on the
target cases, one row each, TDI / wall time / status / gap from one run, every plan replayed by the simulator."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from random_layered import random_layered

from xsched.contracts.graph import Graph
from xsched.contracts.plan import Plan
from xsched.contracts.profile import Profile
from xsched.contracts.result import OrderSearchStats
from xsched.errors import BudgetError, XschedError
from xsched.importers import BENCH_DEVICE, import_networkx
from xsched.simulate import simulate
from xsched.solve.api import solve
from xsched.solve.intervals import solve_intervals
from xsched.solve.options import SolverOptions
from xsched.solve.order.order import search_order
from xsched.solve.problem import Problem
from xsched.solve.reference import eager_peak, eager_plan

BENCH_DIR = Path(__file__).resolve().parents[1] / "benchmarks" / "graphs"
DEV = BENCH_DEVICE
ALL = ("milp", "intervals-highs", "intervals-cpsat", "order-search", "portfolio")


@dataclass(frozen=True)
class Case:
    name: str
    graph: str  # file stem in benchmarks/graphs, or "random_layered:N:SEED"
    budget: float  # bytes when > 1, else a fraction of the eager peak
    limit_s: float
    methods: tuple[str, ...]
    target: str


CASES = (
    Case(
        "n100_fixed",
        "random_layered_n100",
        37055,
        10,
        ("milp", "intervals-highs", "intervals-cpsat"),
        "order fixed: TDI <= 4.1% in <= 10 s",
    ),
    Case(
        "n100_free", "random_layered_n100", 37055, 60, ("order-search", "portfolio"), "order free: <= 2.3% in <= 60 s"
    ),
    Case("n250", "random_layered_n250", 117472, 60, ALL, "TDI <= 1.8% in <= 60 s"),
    Case("resnet50", "checkmate_resnet50_train", 0.8, 60, ALL, "28.4 GB: TDI <= 0.3% in <= 60 s"),
    Case(
        "n500",
        "random_layered:500:0",
        0.9,
        120,
        ("intervals-cpsat", "order-search", "portfolio"),
        "90%: valid plan in <= 120 s, TDI <= 1%",
    ),
)


def load(spec: str) -> tuple[Graph, Profile]:
    if spec.startswith("random_layered:"):
        _, n, seed = spec.split(":")
        path = Path(tempfile.gettempdir()) / f"random_layered_n{n}_s{seed}.json"
        path.write_text(__import__("json").dumps(random_layered(int(n), int(seed))))
        name = f"random_layered_n{n} (seed {seed})"
    else:
        path, name = BENCH_DIR / f"{spec}.json", spec
    g, prof = import_networkx(path)
    return replace(g, name=name), prof


def runner(method: str, g: Graph, prof: Profile, budget: int, opts: SolverOptions) -> Callable[[], Plan]:
    b, devs, homes = {DEV: budget}, [DEV], {v: DEV for v in g.inputs}

    def warm() -> Plan | None:  # the heuristics' best plan, None when none fits
        try:
            return solve(g, prof, b, devs, "heuristics", homes=homes)
        except BudgetError:
            return None

    if method == "milp":
        return lambda: solve(g, prof, b, method="milp", options=opts)
    if method in ("intervals-highs", "intervals-cpsat"):
        backend = method.split("-")[1]

        def fixed() -> Plan:  # the heuristics' warm start inside the time limit
            t0, w = time.perf_counter(), warm()
            o = replace(opts, time_limit_s=opts.time_limit_s - (time.perf_counter() - t0))
            return solve_intervals(
                Problem(g, prof, b, devs, homes), o, backend=backend, order=tuple(range(len(g.ops))), warm_start=w
            )

        return fixed
    if method == "order-search":

        def run() -> Plan:
            t0, w = time.perf_counter(), warm()
            left = opts.time_limit_s - (time.perf_counter() - t0)

            def score(order: tuple[int, ...], seconds: float) -> Plan:
                o = replace(opts, time_limit_s=seconds)
                return solve_intervals(Problem(g, prof, b, devs, homes), o, order=order, warm_start=w, c_max=2)

            plan, _, log = search_order(g, score, left, w)
            if plan is None:
                raise XschedError("no order gave a plan", stage="bench")
            return replace(plan, solver=replace(plan.solver, stats=log))

        return run
    return lambda: solve(g, prof, b, devs, "portfolio", opts, homes)


def run_case(case: Case, threads: int | None, only: Sequence[str] = ()) -> list[dict]:
    g, prof = load(case.graph)
    eager_time = eager_plan(g, DEV, prof).predicted.time_s
    budget = int(case.budget) if case.budget > 1 else int(eager_peak(g) * case.budget)
    rows = []
    for method in (m for m in case.methods if not only or m in only):
        opts = SolverOptions(time_limit_s=case.limit_s, solver_threads=threads)
        row = {
            "case": case.name,
            "graph": g.name,
            "n": len(g.ops),
            "M": budget,
            "method": method,
            "target": case.target,
            "limit": case.limit_s,
        }
        t0 = time.perf_counter()
        try:
            plan = runner(method, g, prof, budget, opts)()
        except XschedError as e:
            row.update(status=f"no plan: {e.detail[:70]}", wall=time.perf_counter() - t0)
        else:
            row["wall"] = time.perf_counter() - t0
            sim = simulate(g, plan, prof)  # budgets included: a plan over M fails here
            x = plan.solver.stats
            row.update(
                status=plan.solver.status,
                gap=plan.solver.gap,
                tdi=100 * (sim.time_s / eager_time - 1),
                peak=sim.peak_bytes[DEV],
                by=plan.solver.found_by,
                order=x.origin if isinstance(x, OrderSearchStats) else "",
            )
        rows.append(row)
        print(
            f"{case.name} {method}: {row['status']} TDI {row.get('tdi', float('nan')):.2f} % in {row['wall']:.1f} s",
            file=sys.stderr,
            flush=True,
        )
    return rows


def table(rows: Sequence[dict]) -> str:
    head = "| case (target) | graph | n | M | method | TDI % | wall s (limit) | status | gap | found by / order | peak of M |"
    out = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        tdi = f"{r['tdi']:.2f}" if "tdi" in r else "-"
        gap = f"{r['gap']:.2%}" if r.get("gap") is not None else "-"
        peak = f"{r['peak'] / r['M']:.1%}" if "peak" in r else "-"
        by = " / ".join(x for x in (r.get("by", ""), r.get("order", "")) if x) or "-"
        out.append(
            f"| {r['case']} ({r['target']}) | {r['graph']} | {r['n']} | {r['M']:,} | {r['method']} | {tdi} "
            f"| {r['wall']:.1f} ({r['limit']:.0f}) | {r['status']} | {gap} | {by} | {peak} |"
        )
    return "\n".join(out)


def compare_main(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default="", help=f"comma-separated, of {', '.join(c.name for c in CASES)}")
    p.add_argument("--threads", type=int, default=None, help="HiGHS threads / CP-SAT workers (default: all cores)")
    p.add_argument("--methods", default="", help="comma-separated: only these of each case's methods")
    p.add_argument("--out", type=Path, help="also write the markdown table here")
    args = p.parse_args(argv)
    only = [m for m in args.methods.split(",") if m]
    names = [n for n in args.cases.split(",") if n]
    rows = []
    t0 = time.perf_counter()
    for case in CASES:
        if not names or case.name in names:
            rows.extend(run_case(case, args.threads, only))
    load_avg = os.getloadavg()
    text = table(rows) + (
        f"\n\nTotal {time.perf_counter() - t0:.0f} s; load average at the end "
        f"{load_avg[0]:.1f} / {load_avg[1]:.1f} / {load_avg[2]:.1f} on {os.cpu_count()} cores."
    )
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0
