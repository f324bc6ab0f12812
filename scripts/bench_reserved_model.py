"""Reserved memory the caching-allocator model (xsched.allocator) expects for plans of GPT-2 (6 layers, batch 8, T1024)
with op costs measured on an NVIDIA H100 (benchmarks/gpu/): PyTorch's default allocator settings against expandable
segments (the executor's `expandable_segments` option), copies' destinations from the side stream's pool or the
compute stream's (`copy_pool`), from the GPU keeping up with the host to the host a step ahead, and planned addresses
(the executor's `planned_addresses`: one arena, the values outside it with expandable segments). Each plan is solved
by `auto` (or read from --plans-dir, where solved plans are kept) and replayed as the executor allocates it (its
in-place reuse included). A model, not a measurement: no GPU runs.

    python scripts/bench_reserved_model.py --plans 55:store,45:store,55:alone --limit 20 --plans-dir /tmp/plans

With --explain: what `xsched plan --explain` says with planned addresses for each plan, and how long it takes.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from xsched.allocator import COPY_POOLS, ReservedPeak, reserved_range
from xsched.allocator.placement import ArenaPlan
from xsched.contracts.graph import Graph
from xsched.contracts.plan import Copy, Plan
from xsched.contracts.profile import Profile
from xsched.errors import BudgetError
from xsched.execute.compiled import reusable_inputs
from xsched.explain import expected_reserved
from xsched.solve import solve
from xsched.solve.options import SolverOptions
from xsched.solve.reference import eager_plan

DATA = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu"
GPU, HOST = "cuda:0", "cpu"
MiB = 1 << 20


def predictions(graph: Graph, plan: Plan, profile: Profile | None) -> dict[tuple[str, bool], tuple[ReservedPeak, ...]]:
    """(copy pool, expandable) -> the GPU's (keeping up, host ahead) predictions; one pool when nothing is copied."""
    reuse = reusable_inputs(graph, plan.steps, frozenset())
    pools = COPY_POOLS if any(isinstance(s, Copy) for s in plan.steps) else COPY_POOLS[:1]
    return {
        (pool, grown): reserved_range(
            graph, plan, profile, devices=[GPU], reuse=reuse, copy_pool=pool, expandable=grown
        )[GPU]
        for pool in pools
        for grown in (False, True)
    }


def cell(low: ReservedPeak, high: ReservedPeak) -> str:
    """Reserved over the plan's peak, and the step's reserved growth against its peak above the homed inputs."""
    over = f"{low.reserved / low.plan_peak:.3f}" + ("" if high == low else f"-{high.reserved / high.plan_peak:.3f}")
    step = f"{low.step_reserved / MiB:,.0f}" + ("" if high == low else f"-{high.step_reserved / MiB:,.0f}")
    return f"{over} ({step} MiB for {low.step_peak / MiB:,.0f})"


def arena_cell(graph: Graph, plan: Plan, profile: Profile | None) -> str:
    """Planned addresses in whole-step runs (`xsched run`, the benchmarks' executors), then where the caller is handed
    the forward outputs at the autograd boundary (`wrap`: those outputs stay outside the arena): reserved over the
    plan's peak (GPU keeping up, host ahead; the values outside the arena with expandable segments), the arena over
    the plan's step peak beside its lower bound (the most placed bytes live at once), the share of the step's
    allocated bytes made outside it."""
    cells = []
    for handed in (False, True):
        arena = ArenaPlan(graph, plan, time_limit_s=10.0, handed=handed, profile=profile)
        a = arena.addresses
        low, high = reserved_range(graph, plan, profile, devices=[GPU], reuse={}, expandable=True, arena=a)[GPU]
        outside = arena.outside_bytes().get(GPU, 0)
        placed = sum(n for (_, d, _), n in a.sizes.items() if d == GPU)
        over = f"{low.reserved / low.plan_peak:.3f}" + ("" if high == low else f"-{high.reserved / high.plan_peak:.3f}")
        lb, top = a.lower_bound.get(GPU, 0) / low.step_peak, a.arena_bytes.get(GPU, 0) / low.step_peak
        share = outside / max(outside + placed, 1)
        cells.append(f"{over}; arena {top:.3f} (bound {lb:.3f}, {a.method}), {share:.0%} outside")
    return " | ".join(cells)


def explain_row(graph: Graph, plan: Plan, profile: Profile, spec: str) -> str:
    """What `xsched plan --explain` says with planned addresses (whole steps, the offsets the run places them at
    (greedy and the seeded search), the default settings outside the arena), the seconds it takes, and the arena CP-SAT finds in 10 s."""
    t = time.perf_counter()
    e = expected_reserved(graph, plan, profile)[GPU]
    took = time.perf_counter() - t
    low, high = e.planned
    over = f"{low.reserved / low.plan_peak:.3f}" + ("" if high == low else f"-{high.reserved / high.plan_peak:.3f}")
    t = time.perf_counter()
    solved = ArenaPlan(graph, plan, time_limit_s=10.0, handed=False, profile=profile).addresses
    took_cpsat = time.perf_counter() - t
    return (
        f"| {spec} | {over} | {e.arena_bytes / MiB:,.0f} | {e.outside / MiB:,.0f} | {took:.2f} "
        f"| {solved.arena_bytes.get(GPU, 0) / MiB:,.0f} ({solved.method}, {took_cpsat:.1f} s) |"
    )


def plan_for(graph: Graph, profile: Profile, spec: str, limit: float, keep: Path | None) -> Plan:
    """`auto`'s plan at "PCT:store" (the host as a store) or "PCT:alone" (the GPU alone), or the eager plan."""
    if spec == "eager":
        return eager_plan(graph, GPU, profile)
    pct, _, where = spec.partition(":")
    path = keep / f"plan_{pct}_{where}.json" if keep else None
    if path is not None and path.exists():
        return Plan.load(path)
    budgets = {GPU: f"{pct}%", **({HOST: "64GiB"} if where == "store" else {})}
    plan = solve(graph, profile, budgets, list(budgets), "auto", SolverOptions(time_limit_s=limit))
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        plan.save(path)
    return plan


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--plans", default="eager,55:store,45:store,55:alone", help="eager, or PCT:store / PCT:alone")
    ap.add_argument("--limit", type=float, default=20.0, help="auto's time limit per plan, seconds")
    ap.add_argument("--plans-dir", type=Path, help="keep solved plans here, and read them back when there")
    ap.add_argument("--profile", default="h100", help="the stored profile: h100 or h200")
    ap.add_argument("--explain", action="store_true", help="instead: --explain's planned-addresses figure, timed")
    a = ap.parse_args(argv)
    graph = Graph.load(DATA / "gpt2-full_n_layer6.graph.json.gz")
    profile = Profile.load(DATA / f"gpt2-full_n_layer6.{a.profile}.profile.json.gz")
    if a.explain:
        print(
            "| plan | reserved / plan peak | arena MiB (as run) | outside it, MiB | seconds | arena MiB, CP-SAT 10 s |"
        )
        print("|---|---|---|---|---|---|")
        for spec in a.plans.split(","):
            print(explain_row(graph, plan_for(graph, profile, spec, a.limit, a.plans_dir), profile, spec), flush=True)
        return 0
    print(
        "| plan | copy pool | default: reserved / plan peak (step) | expandable segments "
        "| planned addresses, whole steps | planned addresses, wrap |"
    )
    print("|---|---|---|---|---|---|")
    for spec in a.plans.split(","):
        try:
            plan = plan_for(graph, profile, spec, a.limit, a.plans_dir)
        except BudgetError as e:  # one budget without a plan must not lose the other rows
            print(f"| {spec} | - | no plan: {e.detail} | |", flush=True)
            continue
        got = predictions(graph, plan, profile)
        placed = arena_cell(graph, plan, profile)
        for pool in dict.fromkeys(p for p, _ in got):
            row = f"| {spec} | {pool} | {cell(*got[pool, False])} | {cell(*got[pool, True])} | {placed} |"
            print(row, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
