"""`xsched demo`: the whole pipeline on one zoo model — capture, profile, solve, simulate, run, compare with eager."""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from xsched.budgets import format_bytes
from xsched.capture.torch import bind_inputs, capture, unpack_outputs
from xsched.execute.reference import run_plan
from xsched.plan import Plan
from xsched.profile.measure import profile_graph
from xsched.simulate import simulate
from xsched.solve.api import solve
from xsched.solve.eager import eager_plan
from xsched.solve.options import SolverOptions
from xsched.zoo import build


def run_demo(
    model: str = "resnet18",
    scale: str = "tiny",
    gpu: str = "sim:rtx4090",
    gpu_budget: str = "4GiB",
    time_limit_s: float = 20.0,
    profile_s: float = 15.0,
) -> int:
    """Plan `model` on the CPU + a simulated GPU, print predicted figures, and check the plan's numbers."""
    z = build(model, scale=scale)
    t0 = time.perf_counter()
    graph = capture(z.model, z.inputs, name=f"{model}-{scale}")
    print(
        f"1. captured {graph.name}: {len(graph.ops)} ops, {len(graph.values)} values ({time.perf_counter() - t0:.1f} s)"
    )
    t0 = time.perf_counter()
    profile = profile_graph(graph, ["cpu", gpu], max_total_s=profile_s, progress=False)
    print(f"2. profiled on cpu and {gpu} ({time.perf_counter() - t0:.1f} s; {gpu} is a roofline model of its spec)")
    budgets = {"cpu": "100%", gpu: gpu_budget}
    plans = {"eager on cpu": eager_plan(graph, "cpu", profile)}
    plans["milp, cpu + gpu"] = solve(
        graph, profile, budgets, method="milp", options=SolverOptions(time_limit_s=time_limit_s)
    )
    print(f"3. solved under budgets {budgets}:")
    _print_plans(graph, profile, plans)
    plan = plans["milp, cpu + gpu"]
    worst = _compare_with_eager(graph, plan, z.model, z.inputs)
    print(f"4. ran the plan step by step (reference interpreter): max |difference| from eager PyTorch = {worst:.3g}")
    return 0 if worst <= 1e-4 else 1


def _print_plans(graph, profile, plans: dict[str, Plan]) -> None:
    print(f"   {'plan':<18} {'solver':<26} {'time':>11} {'overlapped':>11} {'copies':>7}  peak per device")
    for name, plan in plans.items():
        r = simulate(graph, plan, profile)
        peaks = ", ".join(f"{d}={format_bytes(b)}" for d, b in r.peak_bytes.items())
        solver = f"{plan.solver.method} ({plan.solver.status})"
        print(f"   {name:<18} {solver:<26} {r.time_s * 1e3:9.3f}ms {r.makespan_s * 1e3:9.3f}ms {r.copies:>7}  {peaks}")


def _compare_with_eager(graph, plan: Plan, model: torch.nn.Module, inputs: Sequence[torch.Tensor]) -> float:
    """Largest absolute difference between the plan's outputs and gradients and eager PyTorch's, same seed."""
    state = {k: v.clone() for k, v in model.state_dict().items()}
    torch.manual_seed(0)
    out = model(*inputs)
    outs = out if isinstance(out, tuple) else (out,)
    tangents = tuple(torch.ones_like(o) for o in outs if o.requires_grad)
    torch.autograd.backward([o for o in outs if o.requires_grad], tangents)
    want = {n: p.grad for n, p in model.named_parameters()}
    model.load_state_dict(state)
    torch.manual_seed(0)
    env = bind_inputs(graph, model, tuple(inputs), tangents)
    got = unpack_outputs(graph, run_plan(graph, plan, env))
    diffs = [(a - b).abs().max().item() for a, b in zip(got.outputs, outs)]
    diffs += [(got.grads[n] - g).abs().max().item() for n, g in want.items() if g is not None]
    return max(diffs, default=0.0)
