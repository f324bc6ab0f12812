"""Does the back-to-back calibration keep the CPU's fidelity? A small zoo model profiled on logical CPUs, then plans
executed: predicted / measured step with and without the calibration, in one run.

    PYTHONPATH=$PWD python scripts/bench_back_to_back.py [--model gpt2 --scale small:n_layer=2 --budget 60%]

Predicted time: the makespan where the executor overlaps lanes (a GPU), else the sequential time (logical CPUs
run a plan in plan order on the calling thread). Measured: the executor's median step (xsched.execute.back_to_back).
"""

from __future__ import annotations

import argparse
import copy
import time

import torch

from xsched import zoo
from xsched.capture.torch import capture
from xsched.contracts.graph import Graph
from xsched.contracts.plan import Plan
from xsched.contracts.profile import Profile
from xsched.execute.back_to_back import measure_back_to_back, time_plan_step
from xsched.profiling.measure import profile_graph
from xsched.simulate import simulate
from xsched.solve.api import solve
from xsched.solve.reference import eager_plan


def predicted(graph: Graph, plan: Plan, profile: Profile) -> float:
    r = simulate(graph, plan, profile, check_budgets=False)
    return r.time_s if all(d.startswith("cpu") for d in plan.devices) else r.makespan_s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt2")
    ap.add_argument("--scale", default="small:n_layer=2")
    ap.add_argument("--budget", default="60%", help="per device, for the checkpoint plans")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: no spinning on shared cores)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
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
    print("| plan | measured | predicted / measured, alone | predicted / measured, calibrated |")
    print("|---|---|---|---|")
    err = {"alone": 0.0, "calibrated": 0.0}
    for name, plan in plans.items():
        measured = time_plan_step(graph, plan, reps=a.reps)
        r0, r1 = predicted(graph, plan, alone) / measured, predicted(graph, plan, calibrated) / measured
        err["alone"] += abs(r0 - 1)
        err["calibrated"] += abs(r1 - 1)
        print(f"| {name} | {measured * 1e3:.2f} ms | {r0:.3f} | {r1:.3f} |")
    print(
        f"mean |predicted / measured - 1|: alone {err['alone'] / len(plans):.3f}, calibrated {err['calibrated'] / len(plans):.3f}"
    )


if __name__ == "__main__":
    main()
