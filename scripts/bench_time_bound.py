"""How tight is the makespan's lower bound on a GPU beside a CPU that can also compute? Zoo models captured for the
GPU, both devices modelled from their specs (deterministic), every input homed on the GPU: per case, the critical
path with copies free (before) and at their links' time (now, `bounds.chains`), the ops that can run only on the GPU
(before) and those no other device can run within the bound (now), the whole bound before and now, and `auto`'s plan
at full memory with its status and its gap to each bound.

    python scripts/bench_time_bound.py [--models resnet18:tiny,vgg16:small,gpt2:small,unet:small]
        [--machines sim:xeon-e2176g+sim:uhd-p630,sim:xeon-8480+sim:h100] [--time-limit 5]
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from collections.abc import Sequence

from xsched import zoo
from xsched.capture.torch import capture
from xsched.devices.spec import target_device_type
from xsched.profiling.measure import profile_graph
from xsched.solve import SolverOptions, solve
from xsched.solve.bounds.time import time_bounds


def only_there(graph, profile, devices: Sequence[str], device: str) -> float:
    """The seconds of the ops that only `device` can run: the per-device bound as it was."""
    alone = [o.id for o in graph.ops if [d for d in devices if profile.can_run(o.id, d)] == [device]]
    return sum(profile.op_cost(o, device).time_s for o in alone)


def cheapest_path(graph, profile, devices: Sequence[str]) -> float:
    """The critical path as it was: the longest chain of ops, each at its cheapest device, copies free."""
    finish: dict[str, float] = {}
    for o in graph.ops:
        cheapest = min(c.time_s for d in devices if (c := profile.op_cost(o.id, d)) is not None)
        ready = max((finish[graph.producer[v]] for v in o.inputs if v in graph.producer), default=0.0)
        finish[o.id] = ready + cheapest
    return max(finish.values(), default=0.0)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="resnet18:tiny,vgg16:small,gpt2:small,unet:small")
    p.add_argument("--machines", default="sim:xeon-e2176g+sim:uhd-p630,sim:xeon-8480+sim:h100")
    p.add_argument("--time-limit", type=float, default=5.0, help="auto's limit per plan, seconds")
    a = p.parse_args(argv)
    print(
        "| machine | graph | ops | critical path: copies free (before) | with copies (now) | GPU's only ops (before) "
        "| kept on the GPU (now) | bound before | bound now | auto makespan | auto status | gap before | gap now |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for machine in a.machines.split(","):
        cpu, gpu = machine.split("+")
        for spec in a.models.split(","):
            name, scale = spec.split(":")
            z = zoo.build(name, scale=scale)
            typed = target_device_type([cpu, gpu])
            graph = capture(copy.deepcopy(z.model), z.inputs, name=f"{name}-{scale}", device_type=typed)
            profile = profile_graph(graph, [cpu, gpu], progress=False)
            homes = {v: gpu for v in graph.inputs}
            bounds = time_bounds(graph, profile, [cpu, gpu], homes)
            found = {b.by: b.seconds for b in bounds}
            kept = found.get(f"compute on {gpu}", 0.0)
            old = [b.seconds for b in bounds if not b.by.startswith(("compute on ", "critical path"))]
            old += [only_there(graph, profile, [cpu, gpu], d) for d in (cpu, gpu)]
            old += [cheapest_path(graph, profile, [cpu, gpu])]
            before, now = max(old), bounds[0].seconds
            t0 = time.perf_counter()
            plan = solve(graph, profile, {}, [cpu, gpu], "auto", SolverOptions(time_limit_s=a.time_limit), homes)
            span = plan.predicted.makespan_s
            print(
                f"| {machine} | {graph.name} | {len(graph.ops)} | {cheapest_path(graph, profile, [cpu, gpu]) * 1e3:.4g} ms "
                f"| {found['critical path'] * 1e3:.4g} ms "
                f"| {only_there(graph, profile, [cpu, gpu], gpu) * 1e3:.4g} ms | {kept * 1e3:.4g} ms "
                f"| {before * 1e3:.4g} ms | {now * 1e3:.4g} ms | {span * 1e3:.4g} ms "
                f"| {plan.solver.status} ({plan.solver.found_by}, {time.perf_counter() - t0:.1f} s) "
                f"| {span / before - 1:.2%} | {span / now - 1:.2%} |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
