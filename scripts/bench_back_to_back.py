"""Does the back-to-back calibration keep the CPU's fidelity? A small zoo model profiled on logical CPUs, then plans
executed: predicted / measured step with and without the calibration, in one run.

    PYTHONPATH=$PWD python scripts/bench_back_to_back.py [--model gpt2 --scale small:n_layer=2 --budget 60%]
    PYTHONPATH=$PWD python scripts/bench_back_to_back.py --h100 [--eager-ms 121.4 --budgets 63,50,45]
    PYTHONPATH=$PWD python scripts/bench_back_to_back.py --device cuda:0 [--deadline 170 --budgets 45,55,63]

`--h100`: no run, the stored H100 graph and profile (benchmarks/gpu/): the profile calibrated by an eager step
measured on that GPU (`--eager-ms`, default the README's), then GPU-alone plans (`auto` within `--time-limit`):
their predicted step alone and calibrated, and the ratio that multiplies a measured predicted / measured.

`--device D`: one device, as every path now measures a profile (`profile_calibrated`: ops alone, then the eager
step back to back, within `--profile-s`): the model (default GPT-2 with 6 layers, batch 8, on CUDA; `--scale`,
`--batch`) planned on D alone at `--budgets` % of its eager peak and at eager, each plan run by the executor, its
predicted / measured step before (ops alone) and after the calibration. The whole run keeps within `--deadline`
seconds: what does not fit is printed as skipped. `--device cpu:0` runs the same code on the CPU.

Predicted time: the makespan where the executor overlaps lanes (a GPU), else the sequential time (logical CPUs
run a plan in plan order on the calling thread). Measured: the executor's median step (xsched.execute.back_to_back).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import gzip
import json
import time
from pathlib import Path

import torch

from xsched import zoo
from xsched.capture.torch import capture
from xsched.contracts.graph import Graph
from xsched.contracts.plan import Compute, Plan
from xsched.contracts.profile import Profile
from xsched.errors import XschedError
from xsched.execute.back_to_back import WARMUP, measure_back_to_back, profile_calibrated, time_plan_step
from xsched.execute.reference import torch_device
from xsched.profiling.back_to_back import calibrate, eager_alone_times, step_time
from xsched.profiling.measure import profile_graph
from xsched.simulate import simulate
from xsched.solve.api import solve
from xsched.solve.options import SolverOptions
from xsched.solve.reference import eager_plan


def predicted(graph: Graph, plan: Plan, profile: Profile) -> float:
    r = simulate(graph, plan, profile, check_budgets=False)
    return r.time_s if all(d.startswith("cpu") for d in plan.devices) else r.makespan_s


def h100(eager_ms: float, budgets: list[str], time_limit: float) -> None:
    gpu = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu" / "gpt2-full_n_layer6"
    graph = Graph.from_dict(json.loads(gzip.open(f"{gpu}.graph.json.gz").read()))
    alone = Profile.from_dict(json.loads(gzip.open(f"{gpu}.h100.profile.json.gz").read()))
    calibrated = calibrate(graph, alone, {"cuda:0": eager_ms / 1e3})
    b = calibrated.back_to_back["cuda:0"]
    print(
        f"{graph.name} on the H100 profile: {len(graph.ops)} ops, sum alone {b.alone_s * 1e3:.2f} ms, eager step"
        f" {b.step_s * 1e3:.2f} ms measured: fitted overhead {b.overhead_s * 1e6:.1f} us/op"
    )
    print("| plan | computes | predicted alone | predicted calibrated | calibrated / alone | scaled / alone |")
    print("|---|---|---|---|---|---|")
    options = SolverOptions(time_limit_s=time_limit)
    plans = {"eager": eager_plan(graph, "cuda:0")}
    for budget in budgets:
        try:
            plans[f"auto {budget}, cuda:0 alone"] = solve(graph, alone, {"cuda:0": budget}, options=options)
        except XschedError as e:  # a loaded machine may find none within the limit: say so, go on
            print(f"| auto {budget}, cuda:0 alone | {str(e)[:100]} |  |  |  |  |")
    for name, plan in plans.items():
        t0, t1, t2 = (
            simulate(graph, plan, p, check_budgets=False).makespan_s for p in (alone, calibrated, scaled(calibrated))
        )
        n = sum(isinstance(s, Compute) for s in plan.steps)
        print(f"| {name} | {n} | {t0 * 1e3:.2f} ms | {t1 * 1e3:.2f} ms | {t1 / t0:.4f} | {t2 / t0:.4f} |")


def one_device(a: argparse.Namespace) -> None:
    """Profile, calibrate, plan and run on `a.device` alone within `a.deadline` seconds (see the module doc)."""
    start, dev = time.perf_counter(), a.device
    left = lambda: a.deadline - (time.perf_counter() - start)  # noqa: E731  # seconds to the deadline
    cuda = dev.startswith("cuda")
    scale = a.scale if a.scale_given else ("full:n_layer=6" if cuda else a.scale)
    z = zoo.build(a.model, batch=a.batch, scale=scale)
    where = torch_device(dev)  # captured there: a GPU's graph has its own kernels (attention, for one)
    inputs = tuple(x.to(where) for x in z.inputs)
    graph = capture(copy.deepcopy(z.model).to(where), inputs, name=f"{a.model}-{scale}")
    calibrated = profile_calibrated(graph, [dev], max_total_s=max(0.0, min(a.profile_s, 0.4 * left())), progress=False)
    alone = dataclasses.replace(calibrated, back_to_back={})
    run = calibrated.profiling or {}
    print(f"{graph.name} batch {z.inputs[0].shape[0]} on {dev}: {len(graph.ops)} ops; profile {run['wall_s']:.1f} s")
    if dev not in calibrated.back_to_back:
        print(f"  {dev}: no back-to-back calibration within --profile-s; the table shows the ops alone only")
    for d, b in calibrated.back_to_back.items():
        print(
            f"  {d}: eager step back to back {b.step_s * 1e3:.2f} ms (in {run['back_to_back_s']:.1f} s), sum alone"
            f" {b.alone_s * 1e3:.2f} ms, fitted overhead {b.overhead_s * 1e6:.1f} us/op"
        )
        closest = step_time(eager_alone_times(graph, alone, d), b.overhead_s)
        if closest > b.step_s * (1 + 1e-9):  # an op back to back costs at least half its time alone (BackToBack.time)
            print(
                f"  {d}: the model's closest eager step {closest * 1e3:.2f} ms: the ops alone took too long to fit it"
            )
    print("| plan | measured | predicted alone | predicted calibrated | alone / measured | calibrated / measured |")
    print("|---|---|---|---|---|---|")
    todo: dict[str, Plan | str] = {"eager": eager_plan(graph, dev)}
    for budget in a.budgets.split(","):
        limit = min(a.time_limit, left() / 4)
        if limit < 0.5:  # the solvers' set-up alone takes about that
            todo[f"auto {budget}%, {dev} alone"] = "skipped: past --deadline"
            continue
        try:
            todo[f"auto {budget}%, {dev} alone"] = solve(
                graph, calibrated, {dev: f"{budget}%"}, options=SolverOptions(time_limit_s=limit)
            )
        except XschedError as e:  # none found within the limit, or proven none: say which, go on
            todo[f"auto {budget}%, {dev} alone"] = str(e).splitlines()[0][:100]
    err = {"alone": [], "calibrated": []}
    for name, plan in todo.items():
        if isinstance(plan, str):
            print(f"| {name} | {plan} |  |  |  |  |")
            continue
        t_alone, t_cal = predicted(graph, plan, alone), predicted(graph, plan, calibrated)
        if left() < (WARMUP + 2) * max(t_alone, t_cal):  # its build, warm-up and one timed step
            print(f"| {name} | skipped: past --deadline |  |  |  |  |")
            continue
        measured = time_plan_step(graph, plan, reps=a.reps, within_s=left())
        err["alone"].append(abs(t_alone / measured - 1))
        err["calibrated"].append(abs(t_cal / measured - 1))
        print(
            f"| {name} | {measured * 1e3:.2f} ms | {t_alone * 1e3:.2f} ms | {t_cal * 1e3:.2f} ms"
            f" | {t_alone / measured:.3f} | {t_cal / measured:.3f} |"
        )
    if err["alone"]:
        means = ", ".join(f"{m} {sum(e) / len(e):.3f}" for m, e in err.items())
        print(f"mean |predicted / measured - 1| over {len(err['alone'])} plans: {means}")
    print(f"wall {time.perf_counter() - start:.1f} s of --deadline {a.deadline:g} s")


def scaled(profile: Profile) -> Profile:
    """The other model, for comparison: each calibrated device's op times scaled by step / sum alone."""
    compute = dict(profile.compute)
    for d, b in profile.back_to_back.items():
        k = b.step_s / b.alone_s if b.alone_s > 0 else 1.0
        compute[d] = {o: dataclasses.replace(c, time_s=c.time_s * k) for o, c in compute[d].items()}
    return dataclasses.replace(profile, compute=compute, back_to_back={})


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt2")
    ap.add_argument("--scale", help="zoo scale (default small:n_layer=2; full:n_layer=6 with --device cuda)")
    ap.add_argument("--budget", default="60%", help="per device, for the checkpoint plans")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--device", help="one device (cuda:0, cpu:0): profile, calibrate, plan and run there alone")
    ap.add_argument("--batch", type=int, help="with --device: the batch (default: 8 on CUDA, the zoo's on a CPU)")
    ap.add_argument("--deadline", type=float, default=170.0, help="with --device: seconds for the whole run")
    ap.add_argument("--profile-s", type=float, default=40.0, help="with --device: the profile's cap, seconds")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: no spinning on shared cores)")
    ap.add_argument("--h100", action="store_true", help="the stored H100 data instead of a run (no GPU needed)")
    ap.add_argument("--eager-ms", type=float, default=121.4, help="with --h100: the eager step measured there")
    ap.add_argument("--budgets", help="with --h100 or --device: %% of the eager peak, one device alone")
    ap.add_argument("--time-limit", type=float, default=20.0, help="with --h100 or --device: seconds per plan")
    a = ap.parse_args(argv)
    if a.deadline <= 0 or a.profile_s <= 0 or a.reps < 1:
        ap.error("--deadline and --profile-s must be positive seconds, --reps at least 1")
    a.scale_given, a.scale = a.scale is not None, a.scale or "small:n_layer=2"
    a.budgets = a.budgets or ("45,55,63" if a.device else "63,50,45")
    torch.set_num_threads(a.threads)
    if a.device:
        a.batch = a.batch or (8 if a.device.startswith("cuda") else None)
        one_device(a)
        return
    if a.h100:
        h100(a.eager_ms, [f"{b}%" for b in a.budgets.split(",")], a.time_limit)
        return
    z = zoo.build(a.model, scale=a.scale)
    graph = capture(copy.deepcopy(z.model), z.inputs, name=f"{a.model}-{a.scale}")
    t0 = time.perf_counter()
    alone = profile_graph(graph, ["cpu:0", "cpu:1"], progress=False)
    t1 = time.perf_counter()
    calibrated = measure_back_to_back(graph, alone, reps=a.reps)
    t2 = time.perf_counter()
    print(f"{graph.name}: {len(graph.ops)} ops; profile {t1 - t0:.1f} s, back-to-back steps {t2 - t1:.1f} s")
    for d, b in calibrated.back_to_back.items():
        print(
            f"  {d}: eager step back to back {b.step_s * 1e3:.2f} ms, sum alone {b.alone_s * 1e3:.2f} ms,"
            f" fitted overhead {b.overhead_s * 1e6:.1f} us/op"
        )
    plans = {
        "eager cpu:0": eager_plan(graph, "cpu:0"),
        f"checkpoint {a.budget} cpu:0": solve(graph, alone, {"cpu:0": a.budget}, method="checkpoint"),
        f"greedy {a.budget} cpu:0+cpu:1": solve(
            graph, alone, {"cpu:0": a.budget, "cpu:1": "100%"}, ["cpu:0", "cpu:1"], method="greedy"
        ),
    }
    print("| plan | measured | predicted / measured: alone | calibrated | scaled (the other model) |")
    print("|---|---|---|---|---|")
    models = {"alone": alone, "calibrated": calibrated, "scaled": scaled(calibrated)}
    err = dict.fromkeys(models, 0.0)
    for name, plan in plans.items():
        measured = time_plan_step(graph, plan, reps=a.reps)
        ratios = {m: predicted(graph, plan, p) / measured for m, p in models.items()}
        for m, r in ratios.items():
            err[m] += abs(r - 1) / len(plans)
        print(f"| {name} | {measured * 1e3:.2f} ms | " + " | ".join(f"{r:.3f}" for r in ratios.values()) + " |")
    print("mean |predicted / measured - 1|: " + ", ".join(f"{m} {e:.3f}" for m, e in err.items()))


if __name__ == "__main__":
    main()
