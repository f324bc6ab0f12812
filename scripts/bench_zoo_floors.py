"""The lowest budget `auto` reaches on each zoo model at scale "default" on one CPU, beside the heuristics' floor
and the proven lower bound; predicted time overhead at each, measured through `wrap` at 50% and at the floor.

    python scripts/bench_zoo_floors.py --limit 120 --out docs/bench/zoo_floors.md
    python scripts/bench_zoo_floors.py --bounds-only    # the proven bounds alone, from modelled costs


Budgets step down in 5% of the eager peak. The heuristics' floor is the lowest step where the best heuristic plan
fits; from one step below it `auto` (time limit `--limit` per budget) steps down until it returns no plan or the
next step is under the proven bound (`xsched.solve.bounds.memory.lower_bounds`, which no plan can beat). Costs are the
CPU's, measured once per graph and cached under profiles/ (as `wrap` does). Measured overheads are medians of
interleaved training steps (eager PyTorch against the wrapped plan) in this one process.
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from xsched import zoo
from xsched.capture.torch import capture
from xsched.contracts.plan import Plan, ends_on_one_device
from xsched.errors import BudgetError, XschedError
from xsched.execute.back_to_back import stored_profile
from xsched.execute.wrap import wrap
from xsched.solve.api import solve
from xsched.solve.bounds.crossing import crossing_bound
from xsched.solve.bounds.memory import lower_bounds, op_need
from xsched.solve.options import SolverOptions
from xsched.solve.reference import eager_peak, eager_plan

DEV = "cpu"
STEP = 5  # percent of the eager peak


def loss_of(out: object) -> torch.Tensor:
    if isinstance(out, tuple):  # gpt2 returns (logits, loss)
        return out[1]
    return out.float().square().mean()  # type: ignore[union-attr]


def step_time(models: dict[str, torch.nn.Module], inputs: tuple, iters: int) -> dict[str, float]:
    """Median seconds of a training step (zero_grad, forward, loss, backward, SGD) per model, interleaved."""
    steps: dict[str, Callable[[], None]] = {}
    for k, m in models.items():
        opt = torch.optim.SGD(m.parameters(), lr=1e-3)

        def step(m: torch.nn.Module = m, opt: torch.optim.Optimizer = opt) -> None:
            opt.zero_grad(set_to_none=True)
            loss_of(m(*inputs)).backward()
            opt.step()

        steps[k] = step
    times: dict[str, list[float]] = {k: [] for k in steps}
    for i in range(iters + 2):  # two warm-up rounds
        for k, f in steps.items():
            t0 = time.perf_counter()
            f()
            if i >= 2:
                times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def run_model(name: str, limit: float, iters: int) -> dict:
    z = zoo.build(name, scale="default")
    graph = capture(copy.deepcopy(z.model), z.inputs, name=name)
    profile = stored_profile(graph, [DEV])
    peak = eager_peak(graph)
    eager_s = eager_plan(graph, DEV, profile).predicted.time_s
    homes = {v: DEV for v in graph.inputs}
    bound = lower_bounds(graph, profile, [DEV], homes)[DEV].bytes
    bound_pct = 100 * bound / peak
    row: dict = {"model": name, "ops": len(graph.ops), "peak": peak, "bound": bound_pct}

    def budget(pct: int) -> int:
        return int(peak * pct / 100)

    heur: dict[int, Plan] = {}
    pct = 100
    while pct >= STEP:
        try:
            plan = solve(graph, profile, {DEV: budget(pct)}, [DEV], "heuristics", homes=homes)
        except BudgetError:
            break
        heur[pct] = plan
        pct -= STEP
    row["heuristic_floor"] = min(heur)
    plans: dict[int, Plan] = {}
    seconds: dict[int, float] = {}
    pct = row["heuristic_floor"] - STEP
    while pct >= STEP and budget(pct) >= bound:
        t0 = time.perf_counter()
        try:
            plan = solve(graph, profile, {DEV: budget(pct)}, method="auto", options=SolverOptions(time_limit_s=limit))
        except BudgetError as e:
            row["stopped"] = f"{pct}%: {'proven' if 'proven' in e.detail else 'not found'}"
            seconds[pct] = time.perf_counter() - t0
            break
        seconds[pct] = time.perf_counter() - t0
        plans[pct] = plan
        print(
            f"  {name} {pct}%: {plan.solver.found_by} {plan.solver.status} "
            f"+{100 * (plan.predicted.time_s / eager_s - 1):.1f}% in {seconds[pct]:.0f} s",
            file=sys.stderr,
            flush=True,
        )
        pct -= STEP
    else:
        row.setdefault("stopped", f"{pct}%: below the bound" if pct >= STEP else "5% reached")
    row["auto_floor"] = min(plans, default=row["heuristic_floor"])
    floor_plan = plans.get(row["auto_floor"]) or heur[row["auto_floor"]]
    row["floor_by"] = floor_plan.solver.found_by
    row["floor_status"] = floor_plan.solver.status
    row["floor_solve_s"] = seconds.get(row["auto_floor"], 0.0)
    row["pred_floor"] = 100 * (floor_plan.predicted.time_s / eager_s - 1)
    at50 = plans.get(50) or heur.get(50)
    row["pred_50"] = 100 * (at50.predicted.time_s / eager_s - 1) if at50 is not None else math.nan
    # measured: the wrapped plans at 50% and at the floor against eager PyTorch, interleaved in one loop
    models = {"eager": copy.deepcopy(z.model)}
    for key, plan in (("50", at50), ("floor", floor_plan)):
        if plan is not None:
            models[key] = wrap(copy.deepcopy(z.model), z.inputs, {DEV: plan.budgets[DEV]}, plan=plan)
    t = step_time(models, z.inputs, iters)
    for key in ("50", "floor"):
        row[f"meas_{key}"] = 100 * (t[key] / t["eager"] - 1) if key in t else math.nan
    return row


def bounds_table(names: list[str]) -> str:
    """Each model's proven bound on one device (modelled costs: only workspaces matter), what sets it, the
    crossing bound alone (homed inputs + `crossing_bound` with nothing to beat) and the seconds `lower_bounds`
    took."""
    out = [
        "| model | ops | eager peak | proven bound | set by | crossing bound alone | bound s |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in names:
        z = zoo.build(name, scale="default")
        graph = capture(copy.deepcopy(z.model), z.inputs, name=name)
        peak, homes = eager_peak(graph), {v: DEV for v in graph.inputs}
        t0 = time.perf_counter()
        bound = lower_bounds(graph, None, [DEV], homes)[DEV]
        seconds = time.perf_counter() - t0
        need = {op.id: op_need(graph, op, DEV, homes, None) for op in graph.ops}
        alone = crossing_bound(graph, need, DEV, homes, ends_on_one_device(graph, homes), 0)
        homed = sum(graph.value[v].nbytes for v in graph.inputs)
        out.append(
            f"| {name} | {len(graph.ops)} | {peak / 2**20:.1f} MiB | {100 * bound.bytes / peak:.2f}% | {bound.by} "
            f"| {100 * (homed + (alone.bytes if alone else 0)) / peak:.2f}% | {seconds:.2f} |"
        )
        print(out[-1], flush=True)
    return "\n".join(out)


def table(rows: list[dict]) -> str:
    head = (
        "| model | ops | eager peak | proven bound | heuristic floor | auto floor | found by (status, solve s) "
        "| auto stopped at | predicted at 50% | measured at 50% | predicted at floor | measured at floor |"
    )
    out = [head, "|" + "---|" * (head.count("|") - 1)]
    pct = lambda x: "-" if math.isnan(x) else f"{x:+.1f}%"  # noqa: E731
    for r in rows:
        out.append(
            f"| {r['model']} | {r['ops']} | {r['peak'] / 2**20:.1f} MiB | {r['bound']:.1f}% "
            f"| {r['heuristic_floor']}% | **{r['auto_floor']}%** | {r['floor_by']} ({r['floor_status']}, "
            f"{r['floor_solve_s']:.0f} s) | {r['stopped']} | {pct(r['pred_50'])} | {pct(r['meas_50'])} "
            f"| {pct(r['pred_floor'])} | {pct(r['meas_floor'])} |"
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(zoo.names()))
    ap.add_argument("--limit", type=float, default=120.0, help="auto's time limit per budget, seconds")
    ap.add_argument("--iters", type=int, default=10, help="measured training steps per row")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--bounds-only", action="store_true", help="print the proven bounds alone (seconds, not minutes)")
    args = ap.parse_args(argv)
    if args.bounds_only:
        print(bounds_table(args.models.split(",")))
        return 0
    t0 = time.perf_counter()
    rows = []
    for name in args.models.split(","):
        try:
            rows.append(run_model(name, args.limit, args.iters))
        except XschedError as e:
            print(f"{name}: {e}", file=sys.stderr)
            continue
        print(table(rows[-1:]).splitlines()[-1], flush=True)
    la = os.getloadavg()
    text = (
        table(rows) + f"\n\nTotal {time.perf_counter() - t0:.0f} s; auto's limit {args.limit:g} s per budget; "
        f"load average at the end {la[0]:.1f} / {la[1]:.1f} / {la[2]:.1f} on {os.cpu_count()} cores."
    )
    print(text)
    if args.out:
        args.out.write_text(f"# Zoo floors (one CPU, scale default)\n\n{__doc__}\n{text}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
