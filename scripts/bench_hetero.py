"""Heterogeneity benchmark (XEngine-style): MILP plans on CPU + a simulated GPU against the best single-device plan.

For each zoo model (training and inference graphs) the graph is profiled on the real "cpu" and a simulated GPU
("sim:<spec>", analytic roofline model); then, at the GPU's full memory and at a GPU budget below the eager peak
(so the GPU alone cannot hold the eager schedule), it compares the best single-device plan (eager where it fits,
which is optimal on one device, else the MILP with recomputation) with the MILP over both devices, warm-started
from that single-device plan with the same homes. Speedup = single-device time / two-device time - 1.

    python scripts/bench_hetero.py --gpu sim:uhd-p630 --models unet,vgg16 --tight 0.5 --time-limit 120 [--out FILE]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from xsched import zoo
from xsched.budgets import format_bytes
from xsched.capture.torch import capture
from xsched.contracts.graph import Graph
from xsched.contracts.plan import Compute, Copy, Plan
from xsched.contracts.profile import Profile
from xsched.devices.spec import target_device_type
from xsched.errors import BudgetError
from xsched.execute.back_to_back import profile_calibrated
from xsched.solve.api import solve
from xsched.solve.options import SolverOptions
from xsched.solve.reference import eager_peak


def single_device(graph: Graph, profile: Profile, d: str, budget: int | None, options: SolverOptions) -> Plan | None:
    """The best plan on `d` alone (everything homed there), or None when `d` cannot hold the graph at all."""
    budgets = {d: budget} if budget is not None else {}
    # one device, no copies: the eager plan's time (every op once) is a lower bound, so it is optimal when it fits
    method = "eager" if budget is None or eager_peak(graph) <= budget else "milp"
    try:
        return solve(graph, profile, budgets, [d], method, options, homes={v: d for v in graph.inputs})
    except BudgetError:
        return None


def run_case(
    graph: Graph, profile: Profile, cpu: str, gpu: str, gpu_budget: int, options: SolverOptions
) -> dict[str, Any]:
    singles = {d: single_device(graph, profile, d, gpu_budget if d == gpu else None, options) for d in (cpu, gpu)}
    best_d, best = min(((d, p) for d, p in singles.items() if p), key=lambda dp: dp[1].predicted.time_s)
    t0 = time.perf_counter()
    both = solve(graph, profile, {gpu: gpu_budget}, [cpu, gpu], "milp", options, homes=best.homes, warm_start=best)
    wall = time.perf_counter() - t0
    on = [s.device for s in both.steps if isinstance(s, Compute)]
    return {
        "gpu_budget": gpu_budget,
        "cpu_s": singles[cpu].predicted.time_s if singles[cpu] else None,
        "gpu_s": singles[gpu].predicted.time_s if singles[gpu] else None,
        "gpu_how": singles[gpu].solver.method + "/" + singles[gpu].solver.status if singles[gpu] else "cannot hold",
        "best": best_d,
        "best_s": best.predicted.time_s,
        "both_s": both.predicted.time_s,
        "speedup": 100 * (best.predicted.time_s / both.predicted.time_s - 1),
        "split": f"{on.count(gpu)} gpu / {on.count(cpu)} cpu",
        "copies": sum(isinstance(s, Copy) for s in both.steps),
        "status": f"{both.solver.method}/{both.solver.status}",
        "gap": both.solver.gap,
        "solve_s": wall,
        "peak_gpu": both.predicted.peak_bytes.get(gpu, 0),
    }


def table(rows: Sequence[dict[str, Any]], cpu: str, gpu: str) -> str:
    head = (
        f"| graph | ops | {gpu} budget | {cpu} alone | {gpu} alone | best single | {cpu} + {gpu} | speedup | ops split "
        "| copies | MILP status | gap | solve s | XEngine (published) |"
    )
    out = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        ms = lambda x: "-" if x is None else f"{1e3 * x:.2f} ms"  # noqa: E731
        gap = "-" if r["gap"] is None else f"{r['gap']:.2%}"
        out.append(
            f"| {r['graph']} | {r['ops']} | {r['label']} ({format_bytes(r['gpu_budget'])}) | {ms(r['cpu_s'])} "
            f"| {ms(r['gpu_s'])} ({r['gpu_how']}) | {r['best']} | {ms(r['both_s'])} | {r['speedup']:+.1f}% | {r['split']} "
            f"| {r['copies']} | {r['status']} | {gap} | {r['solve_s']:.0f} | {r['published']} |"
        )
    return "\n".join(out)


PUBLISHED = {
    ("unet", "train"): "up to 19.2% (UNet training)",
    ("vgg16", "inference"): "up to 22.5% (VGG19 inference)",
    ("vgg19", "inference"): "up to 22.5% (VGG19 inference)",
}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gpu", default="sim:uhd-p630", help="simulated GPU (sim:<spec>), default XEngine's iGPU")
    p.add_argument("--cpu", default="cpu", help='"cpu" (measured) or a simulated CPU such as sim:xeon-e2176g')
    p.add_argument("--models", default="unet,vgg16")
    p.add_argument("--modes", default="train,inference")
    p.add_argument("--scale", default="default", help="zoo scale")
    p.add_argument("--tight", type=float, default=0.5, help="tight GPU budget, as a fraction of the eager peak")
    p.add_argument("--time-limit", type=float, default=120.0, help="MILP time limit per solve, seconds")
    p.add_argument("--profile-s", type=float, default=120.0, help="CPU profiling time cap per graph, seconds")
    p.add_argument("--out", type=Path, help="also write the markdown table here")
    args = p.parse_args(argv)
    options = SolverOptions(time_limit_s=args.time_limit)
    rows, typed = [], target_device_type([args.cpu, args.gpu])
    for name in args.models.split(","):
        z = zoo.build(name, scale=args.scale)
        for mode in args.modes.split(","):
            graph = capture(  # typed for its devices, as `xsched profile` types it: the GPU's dropout
                z.model, z.inputs, inference=mode == "inference", name=f"{name}-{mode}", device_type=typed
            )
            t0 = time.perf_counter()
            # the CPU measured and calibrated by its eager step back to back; the simulated GPU modelled
            profile = profile_calibrated(graph, [args.cpu, args.gpu], max_total_s=args.profile_s, progress=False)
            print(f"{graph.name}: {len(graph.ops)} ops profiled in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
            full = profile.devices[args.gpu].memory_bytes
            for label, budget in (
                ("full", full),
                (f"{args.tight:.0%} of eager peak", int(args.tight * eager_peak(graph))),
            ):
                r = run_case(graph, profile, args.cpu, args.gpu, budget, options)
                r.update(graph=graph.name, ops=len(graph.ops), label=label, published=PUBLISHED.get((name, mode), "-"))
                rows.append(r)
                print(
                    f"  {label}: speedup {r['speedup']:+.1f}% ({r['status']}, {r['solve_s']:.0f} s)",
                    file=sys.stderr,
                    flush=True,
                )
    text = table(rows, args.cpu, args.gpu)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
