"""GPU memory benchmark (issue 24, item 5): GPT-2 training steps under eager PyTorch, torch's own memory savers and
xsched plans at shares of the eager peak, on the GPU alone and with the host as a store; one run, under 5 minutes.

    python scripts/bench_gpu_memory.py --out gpu_memory.md --json gpu_memory.json      # cuda:0, gpt2 full:n_layer=6
    python scripts/bench_gpu_memory.py --device cpu --scale small --iters 3             # reduced: logical CPUs

A step is the captured graph's: forward, then backward of every differentiable output (logits and loss) with ones
as its gradient; `--loss-backward`: of the loss alone, as `loss.backward()` (every row; the logits still returned
and held, xsched's graph captured with grad_outputs="auto", budgets of its own eager peak). Rows: eager PyTorch; torch.utils.checkpoint around every transformer block;
torch.autograd.graph.save_on_cpu(pin_memory=True); torchtune's OffloadActivations where it imports; the xsched
eager plan; xsched `auto` at each budget on the GPU alone and with the host as a store; xsched on the GPU alone at
the step peak checkpoint measured. The graph is profiled once (time cap --profile-s) and every plan solved from that
profile (--time-limit each, in parallel processes where there are cores to spare). `--device cpu`: cpu:0 computes,
cpu:1 is the store (a copy is a clone), peaks from the CPU allocator's events (torch rows) and the live storages
counted on cpu:0 (xsched rows, xsched.execute.live_bytes); OffloadActivations (CUDA streams) is skipped there. Every
row also has torch.compile's (plain, and with activation_memory_budget at each budget as a fraction), CUDA's reserved
memory beside the allocated, and (with --out) a plot of step time against measured peak for every row beside the
markdown. `--xsched-compile` (default on CUDA) adds an xsched compiled row at every xsched row's budget
(bench_gpu_compiled_rows: wrap(compile=True), its peak from the allocator, its prediction from the regions'
measured allocations). `--expandable-segments` (default on CUDA) adds, after every xsched row, the same plan run with
Executor(expandable_segments=True): PyTorch's expandable_segments:True for that run only (set before it, unset after),
its reserved memory beside the allocator model's prediction with expandable segments; on logical CPUs there is no
caching allocator and the option is a no-op (the row is the plain run again). `--chunk-loss K` adds xsched rows with the store on
the graph with its loss in K row blocks (chunked_rows). The torch rows and the shared timing are in
bench_gpu_torch_rows, the xsched rows in bench_gpu_plan_rows. Setup in scripts/gpu/README.md.
"""

from __future__ import annotations

import argparse
import concurrent.futures as futures
import gzip
import json
import multiprocessing
import os
import platform
import re
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
from bench_cuda import device_name, no_plan, one_line
from bench_gpu_compiled_rows import compiled_plan_rows
from bench_gpu_plan_rows import captured, log_row, plan_row
from bench_gpu_torch_rows import compile_rows, eager_grads, log, step_named, torch_rows
from gpu.memory_report import frontier_plot, mib, render

from xsched import zoo
from xsched.capture.torch import bind_inputs
from xsched.contracts.graph import Graph
from xsched.contracts.plan import Plan
from xsched.contracts.profile import Profile
from xsched.devices import get_device
from xsched.errors import BudgetError
from xsched.execute.back_to_back import profile_calibrated
from xsched.solve.reference import eager_peak, eager_plan


# ---- solving: every plan from the one profile, in parallel processes where cores allow ----
def solve_job(job: tuple) -> Plan | str:
    from xsched.solve import SolverOptions, solve

    graph, profile, budgets, devices, limit, fit_reserved, threads = job
    # each of the parallel solves gets its share of the cores: on the H100's 16, seven solves each asking for 16
    # hier processes and 16 CP-SAT workers starved hier, the only member that plans 45% GPU alone (2026-11-27)
    options = SolverOptions(
        time_limit_s=limit, fit_reserved=fit_reserved, hier_processes=threads, solver_threads=threads
    )
    try:
        return solve(graph, profile, budgets, devices, "auto", options)
    except BudgetError as e:
        return no_plan(e.detail)
    except Exception as e:  # one plan failing must not lose the other rows
        traceback.print_exc()
        return f"error: {one_line(e)}"


def solve_all(jobs: dict[str, tuple], processes: int) -> dict[str, Plan | str]:
    """Each job (graph, profile, budgets, devices, limit, fit_reserved) solved by `auto`, `processes` at a time, each
    with its share of the cores."""
    at_once = max(1, min(processes, len(jobs)))
    threads = max(1, (os.cpu_count() or 1) // at_once)
    jobs = {k: (*j, threads) for k, j in jobs.items()}
    if processes <= 1 or len(jobs) == 1:
        return {k: solve_job(j) for k, j in jobs.items()}
    ctx = multiprocessing.get_context("spawn")  # CUDA is initialised here: never fork
    out: dict[str, Plan | str] = {}
    with futures.ProcessPoolExecutor(min(processes, len(jobs)), mp_context=ctx) as pool:
        done = {k: pool.submit(solve_job, j) for k, j in jobs.items()}
        for k, f in done.items():
            try:
                out[k] = f.result()
            except Exception as e:  # a solver process that died (out of memory, ...)
                out[k] = f"error: {one_line(e)}"
    return out


def chunked_rows(
    graph: Graph,
    env: dict,
    compute: str,
    store: str,
    store_budget: str | int,
    eager: Callable,
    a,
    limit: float,
    ckpt_budget: int | None = None,
    want_grads: dict | None = None,
) -> list[dict]:
    """--chunk-loss K: xsched rows on the graph with its cross-entropy in K row blocks (xsched.capture.chunk_loss),
    with the store at every budget, and at torch checkpoint's measured peak (`ckpt_budget`) both alone and with
    the store (offline on the H100 profile, 1.061x and 1.029x predicted there, against 1.208x and 1.134x on the
    original graph: the loss's vocabulary-sized tensors bound the rest). The chunked graph is profiled on its own; its budgets are bytes of the original
    graph's eager peak (the other rows' percentages), since its own eager peak is lower. Measured as the other
    xsched rows (plan_row), against the same eager PyTorch step."""
    if not a.chunk_loss:
        return []
    from dataclasses import replace

    from xsched.capture.chunk_loss import chunked_as_asked

    chunked = chunked_as_asked(graph, a.chunk_loss)
    chunked = replace(chunked, name=f"{graph.name}-chunk{a.chunk_loss}")  # its own --save-profile files
    profile = profiled(chunked, compute, store, a)
    peak = eager_peak(graph)
    jobs = {
        f"xsched {pct}%, loss in {a.chunk_loss} chunks, {store} store": (
            chunked,
            profile,
            {compute: peak * pct // 100, store: store_budget},
            [compute, store],
            limit,
            a.fit_reserved,
        )
        for pct in a.budgets
    }
    if ckpt_budget:
        for label, budgets, devices in (
            (f"{compute} alone", {compute: ckpt_budget}, [compute]),
            (f"{store} store", {compute: ckpt_budget, store: store_budget}, [compute, store]),
        ):
            key = f"xsched at checkpoint's peak, loss in {a.chunk_loss} chunks, {label}"
            jobs[key] = (chunked, profile, budgets, devices, limit, a.fit_reserved)
    rows: list[dict] = []
    for k, p in solve_all(jobs, a.jobs).items():
        if isinstance(p, str):
            rows.append({"plan": k, "error": p})
            continue
        try:
            got = plan_row(k, chunked, p, profile, env, compute, eager, a, want_grads)  # the row, its twins
        except Exception as e:  # an out-of-memory or a failing plan must not lose the other rows
            traceback.print_exc()
            got = [{"plan": k, "error": f"error: {one_line(e)}"}]
        rows += got
        for row in got:
            if "error" not in row:
                log_row(row)
    return rows


def setup(a: argparse.Namespace) -> tuple[str, str, torch.device, str | int]:
    """(compute device, store device, torch device, the store's budget) of the mode."""
    if a.device == "cpu":
        return "cpu:0", "cpu:1", torch.device("cpu"), "100%"
    return a.device, "cpu", torch.device(a.device), a.store_budget


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda:0", help="cuda:N (the host is the store) or cpu (cpu:0 + cpu:1)")
    ap.add_argument("--scale", help="zoo gpt2 scale (default full:n_layer=6 on CUDA, small on the CPU)")
    ap.add_argument("--batch", type=int, default=8, help="batch")
    ap.add_argument("--budgets", default="63,55,50,45", help="xsched budgets, %% of the simulated eager peak")
    ap.add_argument("--store-budget", default="64GiB", help="the host store's budget on CUDA")
    ap.add_argument("--time-limit", type=float, default=20.0, help="auto's time limit per plan, seconds")
    ap.add_argument("--profile-s", type=float, default=40.0, help="profiling time cap (max_total_s), seconds")
    ap.add_argument("--iters", type=int, default=10, help="timed steps per row")
    ap.add_argument("--warmup", type=int, default=3, help="untimed rounds before them")
    ap.add_argument(
        "--fit-reserved",
        action="store_true",
        help="plan so the allocator model's reserved memory (host a step ahead) fits each budget (solve's "
        "fit_reserved, off by default)",
    )
    ap.add_argument("--jobs", type=int, help="solver processes (default: the cores less two, at most one per plan)")
    ap.add_argument(
        "--deadline",
        type=float,
        default=220.0,
        help="seconds from the start: solves shrink, compiles are skipped to fit",
    )
    ap.add_argument(
        "--compile", action=argparse.BooleanOptionalAction, default=True, help="the torch.compile rows (default: on)"
    )
    ap.add_argument(
        "--xsched-compile",
        action=argparse.BooleanOptionalAction,
        help="xsched compiled rows (wrap(compile=True), inductor on each region) at every xsched row's budget (default: "
        "on CUDA only; inductor on the CPU takes minutes per plan)",
    )
    ap.add_argument(
        "--compile-backend",
        help="torch.compile's backend (default inductor on CUDA; aot_eager_decomp_partition on the CPU: the same min-cut "
        "partitioner and memory budget, without building C++ kernels)",
    )
    ap.add_argument(
        "--lanes",
        action=argparse.BooleanOptionalAction,
        help="measure xsched rows on the executor's lanes and the copy time they hide (default: on CUDA only; on "
        "logical CPUs the lanes are threads sharing the cores, slower than plan order)",
    )
    ap.add_argument(
        "--expandable-segments",
        action=argparse.BooleanOptionalAction,
        help="after every xsched row, the same plan with Executor(expandable_segments=True) (default: on CUDA only; on "
        "logical CPUs a no-op, the plain run again)",
    )
    ap.add_argument(
        "--planned-addresses",
        action=argparse.BooleanOptionalAction,
        help="after every xsched row, the same plan with Executor(planned_addresses=True): the step's values in one "
        "arena per device (default: on CUDA only; on logical CPUs the row is predicted, its peak the executor's count)",
    )
    ap.add_argument(
        "--chunk-loss",
        type=int,
        metavar="K",
        help="also xsched rows with the store on the graph with its cross-entropy in K row blocks, at every budget "
        "(of this graph's eager peak)",
    )
    ap.add_argument(
        "--loss-backward",
        action="store_true",
        help="every row's step backpropagates the loss alone (loss.backward()), not ones into the logits too",
    )
    ap.add_argument("--threads", type=int, help="torch intra-op threads (default: 1 on the CPU, torch's on CUDA)")
    ap.add_argument("--out", type=Path, help="write the markdown here too")
    ap.add_argument("--json", type=Path, help="write the rows and the run's facts here")
    ap.add_argument("--save-profile", type=Path, help="write the graph and its profile (gzipped JSON) into this folder")
    a = ap.parse_args(argv)
    cpu = a.device == "cpu"
    if not cpu and not (a.device.startswith("cuda") and torch.cuda.is_available()):
        ap.error(f"--device {a.device}: no such CUDA device here; --device cpu runs the reduced mode on logical CPUs")
    try:
        a.budgets = [int(b) for b in a.budgets.split(",")]
    except ValueError:
        ap.error(f"--budgets {a.budgets!r}: give whole percentages of the eager peak, e.g. 63,55,50,45")
    a.scale = a.scale or ("small" if cpu else "full:n_layer=6")
    a.compile_backend = a.compile_backend or ("aot_eager_decomp_partition" if cpu else "inductor")
    a.jobs = a.jobs or max(1, (os.cpu_count() or 1) - 2)
    a.lanes = not cpu if a.lanes is None else a.lanes
    a.xsched_compile = not cpu if a.xsched_compile is None else a.xsched_compile
    a.expandable_segments = not cpu if a.expandable_segments is None else a.expandable_segments
    a.planned_addresses = not cpu if a.planned_addresses is None else a.planned_addresses
    a.argv = argv if argv is not None else sys.argv[1:]
    return a


def profiled(graph: Graph, compute: str, store: str, a) -> Profile:
    """The one profile: ops on the compute device and its eager step back to back (calibration) within
    --profile-s, the links to and from the store."""
    d = get_device(compute)
    if hasattr(d, "nvml"):
        d.nvml = None  # type: ignore[attr-defined]  # NVML energy needs a 0.2 s window per op per round
    profile = profile_calibrated(graph, [d], stores=[store], max_total_s=a.profile_s, progress=False)
    if a.save_profile:  # file names of letters, digits, '.', '_' and '-' (what the device tool brings back)
        a.save_profile.mkdir(parents=True, exist_ok=True)
        stem = re.sub(r"[^A-Za-z0-9._-]", "_", graph.name)
        for what, data in (("graph", graph.to_dict()), ("profile", profile.to_dict())):
            with gzip.open(a.save_profile / f"{stem}.{what}.json.gz", "wt") as f:
                json.dump(data, f)
    return profile


def budgets_of(a, compute: str, store: str, store_budget: str, ckpt_budget: int | None) -> dict[str, tuple]:
    """Row label -> (budgets, devices) of each xsched plan to solve."""
    out: dict[str, tuple] = {}
    for pct in a.budgets:
        out[f"xsched {pct}%, {compute} alone"] = ({compute: f"{pct}%"}, [compute])
        out[f"xsched {pct}%, {store} store"] = ({compute: f"{pct}%", store: store_budget}, [compute, store])
    if ckpt_budget:
        out[f"xsched at checkpoint's peak, {compute} alone"] = ({compute: ckpt_budget}, [compute])
    return out


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    t_start = time.perf_counter()
    compute, store, dev, store_budget = setup(a)
    if a.threads or dev.type == "cpu":
        torch.set_num_threads(a.threads or 1)
    z = zoo.build("gpt2", batch=a.batch, scale=a.scale)
    model = z.model.to(dev)
    inputs = tuple(x.to(dev) for x in z.inputs)
    graph = captured(model, inputs, f"gpt2-{a.scale}", a.loss_backward)
    env = bind_inputs(graph, model, inputs)
    resident = sum(graph.value[v].nbytes for v in graph.inputs)
    log(f"{graph.name}: {len(graph.ops)} ops, {graph.fingerprint}, batch {a.batch}, on {device_name(dev)}")
    rows, eager_run, eager_times = torch_rows(model, inputs, dev, a)
    want_grads = eager_grads(model, inputs, a.loss_backward)  # the oracle of every xsched row's gradients
    torch_done = list(rows)
    eager, ckpt = rows[0], rows[1]

    t0 = time.perf_counter()
    profile = profiled(graph, compute, store, a)
    profile_s = time.perf_counter() - t0
    links = ", ".join(
        f"{k} {c.latency_s * 1e6:.1f} us + {c.bytes_per_s / 1e9:.1f} GB/s" for k, c in profile.copy.items()
    )
    log(f"profiled in {profile_s:.1f} s (cap {a.profile_s:g} s); links {links}")
    budgets = budgets_of(a, compute, store, store_budget, resident + ckpt["peak"] if ckpt.get("peak") else None)
    rounds = -(-len(budgets) // min(a.jobs, len(budgets)))
    reserve = len(budgets) * (5 + 4 * (a.warmup + a.iters) * eager["time_s"])  # measuring them, roughly
    limit = max(2.0, min(a.time_limit, (a.deadline - (time.perf_counter() - t_start) - reserve) / rounds - 3))
    t0 = time.perf_counter()
    plans = solve_all({k: (graph, profile, b, ds, limit, a.fit_reserved) for k, (b, ds) in budgets.items()}, a.jobs)
    solve_s = time.perf_counter() - t0
    log(f"{len(plans)} plans solved in {solve_s:.1f} s ({limit:.1f} s limit each, {min(a.jobs, len(plans))} jobs)")

    plans = {"xsched eager plan": eager_plan(graph, compute, profile), **plans}
    for k, p in plans.items():
        if isinstance(p, str):
            rows.append({"plan": k, "error": p})
            continue
        try:
            got_rows = plan_row(k, graph, p, profile, env, compute, eager_run, a, want_grads)
        except Exception as e:  # an out-of-memory or a failing plan must not lose the other rows
            traceback.print_exc()
            rows.append({"plan": k, "error": f"error: {one_line(e)}"})
            continue
        rows += got_rows
        eager_times += got_rows[0]["eager_times"]
        if a.json:  # a run cut short keeps what it measured
            a.json.write_text(json.dumps({"facts": {"partial": True}, "rows": rows}, indent=1, default=str))
        for row in got_rows:
            log_row(row)

    ckpt_budget = resident + ckpt["peak"] if ckpt.get("peak") else None
    chunked = chunked_rows(graph, env, compute, store, store_budget, eager_run, a, limit, ckpt_budget, want_grads)
    rows += chunked
    eager_times += [t for r in chunked for t in r.get("eager_times", [])]

    def publish(partial: bool) -> None:
        """The markdown, the frontier and the JSON of the rows so far (again after the compile rows: a run cut
        short while compiling keeps the rest)."""
        eager["time_s"] = statistics.median(eager_times)  # every eager step of the run
        total_s = time.perf_counter() - t_start
        cmd = " ".join(["python scripts/bench_gpu_memory.py", *a.argv])
        header = [
            f"Command: `{cmd}` ({total_s:.0f} s: profile {profile_s:.0f} s, solves {solve_s:.0f} s at {limit:.0f} s "
            "each)" + (" (partial: the compiled rows follow)" if partial else "") + "  ",
            f"Device: {device_name(dev)}; torch {torch.__version__}, Python {platform.python_version()}, TF32 matmul "
            f"{torch.backends.cuda.matmul.allow_tf32}; graph {len(graph.ops)} ops ({graph.fingerprint}); links {links}",
        ]
        notes = {"cuda": dev.type == "cuda", "lanes": a.lanes, "iters": a.iters, "warmup": a.warmup}
        notes["step"] = step_named(a.loss_backward)
        notes |= {"eager_peak": mib(eager_peak(graph)), "resident": mib(resident)}
        title = f"GPU memory benchmark: {graph.name}, batch {a.batch}, {compute} + the {store} store"
        if a.loss_backward:
            title += ", step loss.backward()"
        text = render(title, header, rows, notes)
        if a.out:
            plot = frontier_plot(rows, a.out.parent / f"{a.out.stem}_frontier.svg", f"{graph.name}: {compute}")
            text += f"\n\nFrontier (step time against measured peak, every row): {plot.name}"
            a.out.write_text(text + "\n")
        if not partial:
            print(text, flush=True)
        if a.json:
            facts = {"command": cmd, "device": device_name(dev), "torch": torch.__version__, "partial": partial}
            facts |= {"step": step_named(a.loss_backward), "loss_backward": a.loss_backward}
            facts |= {"graph": graph.fingerprint, "ops": len(graph.ops), "resident": resident, "profile_s": profile_s}
            facts |= {"solve_s": solve_s, "time_limit_s": limit, "total_s": total_s}
            facts |= {"links": {k: vars(v) for k, v in profile.copy.items()}}
            a.json.write_text(json.dumps({"facts": facts, "rows": rows}, indent=1, default=str))

    if a.compile:
        publish(partial=True)
        compiled = compile_rows(model, inputs, dev, eager_run, a, t_start)
        rows[len(torch_done) : len(torch_done)] = compiled
        eager_times += [t for r in compiled for t in r.get("eager_times", [])]
    if a.xsched_compile:
        publish(partial=True)
        compiled = compiled_plan_rows(model, inputs, profile, budgets, store, eager_run, a, t_start)
        rows += compiled
        eager_times += [t for r in compiled for t in r.get("eager_times", [])]
    publish(partial=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
