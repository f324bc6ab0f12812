"""Measuring how a device runs ops back to back: the eager step on it, run by the executor, for the profile's
back-to-back calibration (contract 2, BackToBack)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Mapping, Sequence

import torch

from xsched.contracts.graph import Graph
from xsched.contracts.plan import Plan
from xsched.contracts.profile import Profile
from xsched.contracts.torch_ops import op_input_tensors
from xsched.execute.executor import Executor
from xsched.profiling.back_to_back import calibrate
from xsched.solve.reference import eager_plan

REPS = 5  # timed eager steps per device (after WARMUP untimed): the median is kept
WARMUP = 2  # the first steps build the executor's programs and fill the allocator's caches


def graph_inputs(graph: Graph, device: torch.device) -> dict[str, torch.Tensor]:
    """Random graph inputs, each valid for the first op that reads it (indices below the size they index)."""
    gen = torch.Generator(device).manual_seed(0) if device.type != "meta" else None
    pending, env = set(graph.inputs), {}
    for op in graph.ops:
        wanted = [v for v in dict.fromkeys(op.inputs) if v in pending]
        if wanted:
            made = op_input_tensors(graph, op, device, gen)
            env.update({v: made[v] for v in wanted})
            pending.difference_update(wanted)
    return env


def time_plan_step(
    graph: Graph, plan: Plan, devices: Mapping[str, torch.device | str] | None = None, reps: int = REPS
) -> float:
    """Median seconds of `plan` through the executor, every device synchronised around each step; WARMUP
    untimed steps first. Graph inputs are made on their homes' devices."""
    executor = Executor(graph, plan, devices)
    env = {}
    for d in dict.fromkeys(plan.homes.values()):
        made = graph_inputs(graph, executor.dev[d])
        env.update({v: made[v] for v, home in plan.homes.items() if home == d})
    gpus = [t for t in executor.dev.values() if t.type == "cuda"]

    def sync() -> None:
        for t in gpus:
            torch.cuda.synchronize(t)

    samples = []
    for k in range(WARMUP + reps):
        sync()
        start = time.perf_counter()
        executor(env)
        sync()
        if k >= WARMUP:
            samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def time_eager_step(
    graph: Graph, device: str, devices: Mapping[str, torch.device | str] | None = None, reps: int = REPS
) -> float:
    """Median seconds of the eager plan on `device` through the executor: its one-device program, every op in
    graph order, back to back."""
    return time_plan_step(graph, eager_plan(graph, device), devices, reps)


def measure_back_to_back(
    graph: Graph,
    profile: Profile,
    devices: Sequence[str] | None = None,
    torch_devices: Mapping[str, torch.device | str] | None = None,
    reps: int = REPS,
) -> Profile:
    """`profile` calibrated on each of `devices` by its measured back-to-back eager step. Default: every device the
    torch executor runs (a CPU or a GPU, not simulated, not ONNX Runtime) that runs every op of the graph."""
    names = devices if devices is not None else executable_devices(graph, profile)
    steps = {d: time_eager_step(graph, d, torch_devices, reps) for d in names}
    return calibrate(graph, profile, steps)


def executable_devices(graph: Graph, profile: Profile) -> list[str]:
    """The profile's devices whose eager step the executor can run: torch CPUs and GPUs that run every op."""
    return [
        d
        for d, info in profile.devices.items()
        if info.kind in ("cpu", "cuda")
        and not info.extra.get("simulated")
        and all(op.id in profile.compute.get(d, {}) for op in graph.ops)
    ]
