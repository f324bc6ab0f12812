"""Offload benchmark: parking activations on a second device (method "offload") against recomputation ("checkpoint"),
and both chosen together ("park").

Part A (measured): two logical CPU devices, "cpu:0" computes and "cpu:1" is the store (the same CPU with separate
stores; a copy between them is a tensor clone). The profile is measured once on "cpu:threads=1" (the registry has no
"cpu:N" names); its op costs become cpu:0's, cpu:1 gets none (a store computes nothing, so the offload search cannot
move the whole step onto the store), and both links are the latency + bandwidth fit of a measured one-thread memcpy.
For each zoo model and each cpu:0 budget (a fraction of the eager peak; raised in 5% steps to the first one where
either method fits) it plans offload (cpu:1 at 100% of the eager peak) and checkpoint (cpu:0 alone), reports the plan
facts and the simulator's predictions, and runs the eager, offload and checkpoint plans through the executor,
interleaved, medians of the step times as ratios to the eager plan's.

Part B (predicted only): a simulated GPU computes and the real "cpu" stores over the spec's host link, same method.

    python scripts/bench_offload.py --iters 15 --out docs/bench/offload.md
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import statistics
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from bench_offload_report import report

from xsched import zoo
from xsched.budgets import format_bytes
from xsched.capture.torch import bind_inputs, capture
from xsched.contracts.graph import Graph
from xsched.contracts.plan import Compute, Copy, Plan
from xsched.contracts.profile import DeviceInfo, LinkCost, Profile
from xsched.contracts.result import HeuristicStats
from xsched.devices.base import fit_link, get_device
from xsched.errors import BudgetError
from xsched.execute.back_to_back import profile_calibrated
from xsched.execute.executor import Executor
from xsched.profiling.measure import COPY_SIZES, copy_seconds, profile_graph
from xsched.simulate import simulate
from xsched.solve import solve
from xsched.solve.reference import eager_peak

# name/batch/scale: tiny widths with a large batch, so activations outweigh params (as in tests/test_executor.py
# ZOO) and one step takes 20-60 ms on one thread here
MODELS_A = "gpt2/96/tiny:n_layer=6,transformer/96/tiny,unet/48/tiny,resnet50/96/tiny"
# part B adds the zoo's default scales (more work per op, so a GPU's compute can hide more of the copies)
MODELS_B = MODELS_A + ",gpt2/8/default,transformer/32/default,unet/4/default,resnet50/64/default"


def workload(spec: str) -> tuple[zoo.ZooModel, Graph, str]:
    """A "name/batch/scale" spec -> the zoo model, its captured training graph, and a label."""
    name, batch, scale = spec.split("/", 2)
    z = zoo.build(name, batch=int(batch), scale=scale)
    return z, capture(z.model, z.inputs, name=f"{name}-b{batch}"), f"{name} (b{batch}, {scale})"


def link_between(a: str, b: str) -> LinkCost:
    """The latency + bandwidth fit of copies a->b over COPY_SIZES, timed (or modelled) by the device plugins."""
    da, db = get_device(a), get_device(b)
    return LinkCost(*fit_link(COPY_SIZES, [copy_seconds(da, db, n) for n in COPY_SIZES]))


def with_store(
    profile: Profile, compute: str, store: str, info: DeviceInfo, link: tuple[LinkCost, LinkCost]
) -> Profile:
    """`profile`'s op costs (and back-to-back calibration) on `compute` only, plus a store device that runs no op,
    linked both ways."""
    return Profile(
        profile.graph,
        {compute: profile.devices[compute], store: info},
        {compute: profile.compute[compute], store: {}},
        {f"{compute}->{store}": link[0], f"{store}->{compute}": link[1]},
        {compute: profile.energy_source.get(compute, "model"), store: "model"},
        back_to_back={d: b for d, b in profile.back_to_back.items() if d == compute},
    )


def renamed(profile: Profile, old: str, new: str) -> Profile:
    """The same costs under another device name (a measured "cpu:threads=1" becomes the logical "cpu:0")."""
    return dataclasses.replace(
        profile,
        devices={new if d == old else d: i for d, i in profile.devices.items()},
        compute={new if d == old else d: c for d, c in profile.compute.items()},
        energy_source={new if d == old else d: s for d, s in profile.energy_source.items()},
        back_to_back={new if d == old else d: b for d, b in profile.back_to_back.items()},
        copy={},
    )


def free_copies(profile: Profile) -> Profile:
    """The same profile with every copy costing zero."""
    return dataclasses.replace(profile, copy={k: LinkCost(0.0, math.inf) for k in profile.copy})


def hidden_share(graph: Graph, plan: Plan, profile: Profile) -> tuple[float, float | None]:
    """(total copy seconds, share of it hidden behind other work): 1 - (makespan - makespan with free copies) /
    total copy seconds, all from the simulator's overlapped model. None when the plan copies nothing."""
    sim = simulate(graph, plan, profile, check_budgets=False)
    copy_s = sum(e - s for (s, e), st in zip(sim.step_span, plan.steps) if isinstance(st, Copy))
    if copy_s <= 0:
        return 0.0, None
    free = simulate(graph, plan, free_copies(profile), check_budgets=False)
    return copy_s, 1.0 - (sim.makespan_s - free.makespan_s) / copy_s


def plan_pair(
    graph: Graph, profile: Profile, compute: str, store: str, percent: int, homes: Mapping[str, str]
) -> dict[str, Plan | str]:
    """Offload, checkpoint and park plans within `percent`% of the eager peak on `compute` (the store at 100%), or
    why not."""
    peak = eager_peak(graph)
    budget = peak * percent // 100
    out: dict[str, Plan | str] = {}
    for method, budgets, devices in (
        ("offload", {compute: budget, store: peak}, [compute, store]),
        ("checkpoint", {compute: budget}, [compute]),
        ("park", {compute: budget, store: peak}, [compute, store]),  # parking and recomputing chosen together
    ):
        try:
            out[method] = solve(graph, profile, budgets, devices, method, homes=homes)
        except BudgetError as e:
            out[method] = str(e).splitlines()[0]
    return out


def first_fit(
    graph: Graph, profile: Profile, compute: str, store: str, target: int, homes: Mapping[str, str]
) -> tuple[int, dict[str, Plan | str]]:
    """`plan_pair` at `target`%, else at the first 5% step above it where either method fits."""
    for percent in range(target, 101, 5):
        plans = plan_pair(graph, profile, compute, store, percent, homes)
        if any(isinstance(p, Plan) for p in plans.values()):
            return percent, plans
    return target, plans


def facts(graph: Graph, plan: Plan, profile: Profile) -> dict[str, Any]:
    """Plan facts and simulator predictions; every plan is checked by the simulator within its budgets."""
    sim = simulate(graph, plan, profile)
    stats = plan.solver.stats if isinstance(plan.solver.stats, HeuristicStats) else HeuristicStats()
    copy_s, hidden = hidden_share(graph, plan, profile)
    return {
        "parked": stats.parked,
        "recomputes": sum(isinstance(s, Compute) for s in plan.steps) - len(graph.ops),
        "prefetch": stats.prefetch_ops if stats.prefetch_ops is not None else "-",
        "copies": sum(isinstance(s, Copy) for s in plan.steps),
        "seq_s": sim.time_s,
        "makespan_s": sim.makespan_s,
        "peak": dict(sim.peak_bytes),
        "copy_s": copy_s,
        "hidden": hidden,
    }


def measure_interleaved(
    graph: Graph, plans: Mapping[str, Plan], env: Mapping[str, torch.Tensor], iters: int, warmup: int = 2
) -> dict[str, tuple[float, float, dict[str, int]]]:
    """Per plan: median executor step time over `iters` interleaved rounds, run as the executor does by default
    (logical CPUs: every step in plan order in the calling thread) and on its lanes (overlap=True: a thread per
    stream, copies overlapping compute), and the executor's resident-byte peak per device. The order rotates each
    round, so load from other jobs spreads over all plans and modes."""
    exs = {
        (k, lanes): Executor(graph, p, check=False, overlap=lanes or None)
        for k, p in plans.items()
        for lanes in (False, True)
    }
    runs = list(exs)
    times: dict[tuple[str, bool], list[float]] = {r: [] for r in runs}
    peaks: dict[str, dict[str, int]] = {k: {} for k in plans}
    try:
        for r in range(warmup + iters):
            for k, lanes in runs[r % len(runs) :] + runs[: r % len(runs)]:
                t0 = time.perf_counter()
                st = exs[(k, lanes)].start(env)
                exs[(k, lanes)].run(st)
                dt = time.perf_counter() - t0
                if r >= warmup:
                    times[(k, lanes)].append(dt)
                    for d, b in st.peak().items():
                        peaks[k][d] = max(peaks[k].get(d, 0), b)
    finally:
        for ex in exs.values():
            ex.close()
    med = {r: statistics.median(ts) for r, ts in times.items()}
    return {k: (med[(k, False)], med[(k, True)], peaks[k]) for k in plans}


def with_lanes(graph: Graph, plan: Plan, store: str) -> Plan:
    """`plan` plus one copy of a graph output to `store` at the end: the same work, but a plan with a copy runs
    every step on the executor's lanes (threads), so this measures the lanes' own overhead."""
    c = next(s.device for s in plan.steps if isinstance(s, Compute))
    out = min(graph.outputs, key=lambda v: graph.value[v].nbytes)
    lanes = dataclasses.replace(plan, steps=(*plan.steps, Copy(out, c, store)), budgets={})
    simulate(graph, lanes)  # a valid plan
    return lanes


def budget_label(percent: int, target: int, peak: int) -> str:
    """ "50% (12 MiB)", or with the asked budget when nothing fitted there: "30% (3 MiB; none fits 25%)"."""
    asked = "" if percent == target else f"; none fits {target}%"
    return f"{percent}% ({format_bytes(peak * percent // 100)}{asked})"


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{1e3 * x:.2f} ms"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def part_a(spec: str, args: argparse.Namespace) -> tuple[list[str], list[str], str]:
    z, graph, label = workload(spec)
    t0 = time.perf_counter()
    # the ops alone, then the eager step back to back (the calibration every measured profile gets), on one thread
    measured = profile_calibrated(graph, ["cpu:threads=1"], max_total_s=args.profile_s, progress=False)
    link = link_between("cpu:threads=1", "cpu:threads=1")
    info = measured.devices["cpu:threads=1"]
    profile = with_store(renamed(measured, "cpu:threads=1", "cpu:0"), "cpu:0", "cpu:1", info, (link, link))
    log(f"{graph.name}: {len(graph.ops)} ops profiled in {time.perf_counter() - t0:.0f} s")
    homes = {v: "cpu:0" for v in graph.inputs}
    peak = eager_peak(graph)
    eager = solve(graph, profile, {}, ["cpu:0"], "eager", homes=homes)
    rows: dict[str, tuple[int, str, Plan | str]] = {"eager": (100, "eager", eager)}
    targets: dict[str, int] = {}
    for target in args.budgets:
        percent, plans = first_fit(graph, profile, "cpu:0", "cpu:1", target, homes)
        for method, p in plans.items():  # a lower target that fell back to a budget shown already adds nothing
            rows[f"{method}@{percent}"] = (percent, method, p)
            targets.setdefault(f"{method}@{percent}", target)
    runnable = {k: p for k, (_, _, p) in rows.items() if isinstance(p, Plan)}
    runnable["lanes"] = with_lanes(graph, eager, "cpu:1")
    env = bind_inputs(graph, z.model, z.inputs)
    runs = measure_interleaved(graph, runnable, env, args.iters)
    base_f = facts(graph, eager, profile)
    base_t, base_lanes = runs["eager"][:2]
    label = f"{label[:-1]}, {len(graph.ops)} ops)"
    lines = []
    for key, (percent, method, p) in rows.items():
        budget = budget_label(percent, targets.get(key, percent), peak)
        if not isinstance(p, Plan):
            lines.append(f"| {label} | {budget} | {method} | no plan: {p.removeprefix('[solve] ')[:200]} |" + " |" * 12)
            continue
        f = facts(graph, p, profile)
        t, on_lanes, got = runs[key]
        hidden = "-" if f["hidden"] is None else f"{_pct(f['hidden'])} of {_ms(f['copy_s'])}"
        lines.append(
            f"| {label} | {budget} | {method} | {f['parked']} | {f['recomputes']} | {f['prefetch']} "
            f"| {_ms(f['seq_s'])} | {_ms(f['makespan_s'])} | {f['makespan_s'] / base_f['makespan_s']:.2f} "
            f"| {hidden} | {_ms(t)} | **{t / base_t:.2f}** | {_ms(on_lanes)}, {on_lanes / base_lanes:.2f} "
            f"| {format_bytes(f['peak'].get('cpu:0', 0))} / {format_bytes(got.get('cpu:0', 0))} "
            f"| {format_bytes(f['peak'].get('cpu:1', 0))} / {format_bytes(got.get('cpu:1', 0))} |"
        )
        log(f"  {key}: measured {t / base_t:.2f}x eager, predicted {f['makespan_s'] / base_f['makespan_s']:.2f}x")
    t, on_lanes, got = runs["lanes"]
    lines.append(
        f"| {label} | 100% | eager + 1 copy (lanes control) | 0 | 0 | - | - | - | - | - | {_ms(t)} "
        f"| **{t / base_t:.2f}** | {_ms(on_lanes)}, {on_lanes / base_lanes:.2f} | - / {format_bytes(got.get('cpu:0', 0))} "
        f"| - / {format_bytes(got.get('cpu:1', 0))} |"
    )
    note = f"{graph.name}: {1e6 * link.latency_s:.1f} us + {link.bytes_per_s / 1e9:.1f} GB/s"
    return lines, floor_rows(graph, profile, "cpu:0", "cpu:1", homes, label, max(args.budgets)), note


def floor_rows(
    graph: Graph, profile: Profile, compute: str, store: str, homes: Mapping[str, str], label: str, top: int
) -> list[str]:
    """Per method, how far it reaches: going down from `top`% of the eager peak in 5% steps, the last budget on
    `compute` its search fits before the first it does not, with the plan there."""
    peak = eager_peak(graph)
    base = simulate(graph, solve(graph, profile, {}, [compute], "eager", homes=homes), profile).makespan_s
    out = []
    for method in ("offload", "checkpoint", "park"):
        found = None
        for percent in range(top, 0, -5):
            p = plan_pair(graph, profile, compute, store, percent, homes)[method]
            if not isinstance(p, Plan):
                break
            found = (percent, p)
        if found is None:
            out.append(f"| {label} | {method} | above {top}% | | | | |")
            continue
        percent, p = found
        f = facts(graph, p, profile)
        out.append(
            f"| {label} | {method} | {percent}% ({format_bytes(peak * percent // 100)}) | {f['parked']} "
            f"| {f['recomputes']} | {f['makespan_s'] / base:.2f} | {format_bytes(f['peak'].get(store, 0))} |"
        )
    return out


def part_b(spec: str, args: argparse.Namespace) -> list[str]:
    _, graph, label = workload(spec)
    gpu, cpu = args.gpu, "cpu"
    modelled = profile_graph(graph, [gpu], progress=False)
    link = (link_between(gpu, cpu), link_between(cpu, gpu))
    profile = with_store(modelled, gpu, cpu, get_device(cpu).info(), link)
    homes = {v: gpu for v in graph.inputs}
    peak = eager_peak(graph)
    base = facts(graph, solve(graph, profile, {}, [gpu], "eager", homes=homes), profile)
    lines = [f"| {label} | 100% | eager | 0 | 0 | - | {_ms(base['makespan_s'])} | 1.00 | - | - |"]
    shown = set()
    for target in args.budgets:
        percent, plans = first_fit(graph, profile, gpu, cpu, target, homes)
        if percent in shown:  # a lower target fell back to a budget shown already
            lines.append(f"| {label} | {target}% | neither method fits from {target}% to {percent - 5}% |" + " |" * 7)
            continue
        shown.add(percent)
        budget = budget_label(percent, target, peak)
        for method, p in plans.items():
            if not isinstance(p, Plan):
                lines.append(
                    f"| {label} | {budget} | {method} | no plan: {p.removeprefix('[solve] ')[:200]} |" + " |" * 6
                )
                continue
            f = facts(graph, p, profile)
            hidden = "-" if f["hidden"] is None else _pct(f["hidden"])
            lines.append(
                f"| {label} | {budget} | {method} | {f['parked']} | {f['recomputes']} | {f['prefetch']} "
                f"| {_ms(f['makespan_s'])} | {f['makespan_s'] / base['makespan_s']:.2f} | {_ms(f['copy_s'])} "
                f"| {hidden} |"
            )
    log(f"{graph.name} on {gpu}: done")
    return lines


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=MODELS_A, help="part A: name/batch/scale,...")
    p.add_argument("--models-b", default=MODELS_B, help="part B: name/batch/scale,...")
    p.add_argument("--budgets", default="50,25", help="compute-device budgets, percent of the eager peak")
    p.add_argument("--iters", type=int, default=21, help="measured rounds per plan (after 2 warm-up rounds)")
    p.add_argument("--profile-s", type=float, default=40.0, help="CPU profiling time cap per graph, seconds")
    p.add_argument("--gpu", default="sim:h100", help="part B's simulated compute device")
    p.add_argument("--skip-a", action="store_true", help="part B only")
    p.add_argument("--out", type=Path, help="also write the markdown fragment here")
    args = p.parse_args(argv)
    args.budgets = [int(b) for b in args.budgets.split(",")]
    torch.set_num_threads(1)  # plans run, and the CPU profile is measured, on one thread
    start, load = time.strftime("%H:%M", time.gmtime()), os.getloadavg()[0]
    part = {"a": [], "floors": [], "b": []}
    notes = []
    for spec in [] if args.skip_a else args.models.split(","):
        lines, floors, note = part_a(spec, args)
        part["a"] += lines
        part["floors"] += floors
        notes.append(note)
    part["b"] = [line for spec in args.models_b.split(",") for line in part_b(spec, args)]
    cmd = " ".join(["python scripts/bench_offload.py", *(argv if argv is not None else sys.argv[1:])])
    text = report(args, part, notes, cmd, start, load)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
