"""Measuring how a device runs ops back to back: the eager step on it, run by the executor, for the profile's
back-to-back calibration (contract 2, BackToBack)."""

from __future__ import annotations

import logging
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from xsched.contracts.graph import Graph
from xsched.contracts.plan import Plan
from xsched.contracts.profile import Profile
from xsched.contracts.torch_ops import laid_out, op_input_tensors
from xsched.devices.base import Device
from xsched.execute.executor import Executor
from xsched.pipeline import measured_profile
from xsched.profiling import timecap
from xsched.profiling.back_to_back import calibrate, eager_alone_times
from xsched.profiling.measure import profile_graph
from xsched.solve.reference import eager_plan

log = logging.getLogger(__name__)

REPS = 5  # timed eager steps per device (after WARMUP untimed): the median is kept
WARMUP = 2  # the first steps build the executor's programs and fill the allocator's caches
BUILD_STEPS = 1  # building the executor is counted as about one more step when fitting the reps into a cap
SHARE = 0.1  # of a capped profiling run, kept back from measuring ops for the back-to-back steps


def graph_inputs(graph: Graph, device: torch.device) -> dict[str, torch.Tensor]:
    """Random graph inputs, each valid for the first op that reads it (indices below the size they index); integer
    buffers are zeros: model state such as BERT's token types (gathered by position, then looked up in a table of
    2 rows), which ops after the first reader index with, so no bound the first reader knows makes them valid."""
    gen = torch.Generator(device).manual_seed(0) if device.type != "meta" else None

    def zeros(v: str) -> torch.Tensor:
        return laid_out(graph.value[v], lambda n, dt: torch.zeros(n, dtype=dt, device=device))[1]

    pending, env = set(graph.inputs), {}
    for v in [v for v in graph.inputs if graph.value[v].kind == "buffer" and _integer(graph.value[v].dtype)]:
        env[v] = zeros(v)
        pending.discard(v)
    for op in graph.ops:
        wanted = [v for v in dict.fromkeys(op.inputs) if v in pending]
        if wanted:
            made = op_input_tensors(graph, op, device, gen)
            env.update({v: made[v] for v in wanted})
            pending.difference_update(wanted)
    for v in pending:  # read by no op (a buffer the step only overwrites, as spectral norm's `_u`): any values
        env[v] = zeros(v)
    return env


def _integer(dtype: str | None) -> bool:
    return dtype is not None and not getattr(torch, dtype).is_floating_point and dtype != "bool"


def time_plan_step(
    graph: Graph,
    plan: Plan,
    devices: Mapping[str, torch.device | str] | None = None,
    reps: int = REPS,
    within_s: float | None = None,
) -> float:
    """Median seconds of `plan` through the executor, every device synchronised around each step; WARMUP
    untimed steps first. Graph inputs are made on their homes' devices. `within_s`: no further timed step once
    the next (as long as the longest so far) would end after that many seconds from the call; at least one."""
    begin = timecap.clock()
    executor = Executor(graph, plan, devices)
    env = {}
    for d in dict.fromkeys(plan.homes.values()):
        made = graph_inputs(graph, executor.dev[d])
        env.update({v: made[v] for v, home in plan.homes.items() if home == d})
    gpus = [t for t in executor.dev.values() if t.type == "cuda"]

    def sync() -> None:
        for t in gpus:
            torch.cuda.synchronize(t)

    samples: list[float] = []
    for k in range(WARMUP + reps):
        sync()
        start = timecap.clock()
        executor(env)
        sync()
        end = timecap.clock()
        if k >= WARMUP:
            samples.append(end - start)
            if within_s is not None and end - begin + max(samples) > within_s:
                break
    return statistics.median(samples)


def time_eager_step(
    graph: Graph,
    device: str,
    devices: Mapping[str, torch.device | str] | None = None,
    reps: int = REPS,
    within_s: float | None = None,
) -> float:
    """Median seconds of the eager plan on `device` through the executor: its one-device program, every op in
    graph order, back to back (`within_s`: as time_plan_step)."""
    return time_plan_step(graph, eager_plan(graph, device), devices, reps, within_s)


def measure_back_to_back(
    graph: Graph,
    profile: Profile,
    devices: Sequence[str] | None = None,
    torch_devices: Mapping[str, torch.device | str] | None = None,
    reps: int = REPS,
    within_s: float | None = None,
) -> Profile:
    """`profile` calibrated on each of `devices` by its measured back-to-back eager step. Default: every device the
    torch executor runs (a CPU or a GPU, not simulated, not ONNX Runtime) that runs every op of the graph.
    `within_s`: the seconds all devices' steps may take. A device starts only if its build, warm-up and one timed
    step fit what is left (each step expected to take the sum of its ops alone), and its timed steps stop where the
    next would not fit; one that cannot start keeps no calibration (logged)."""
    names = devices if devices is not None else executable_devices(graph, profile)
    start, steps = timecap.clock(), {}
    for d in names:
        left = None if within_s is None else within_s - (timecap.clock() - start)
        if left is not None and not fits_one_step(left, graph, profile, d):
            log.warning("no back-to-back calibration of %s: its eager steps do not fit the profiling cap", d)
            continue
        steps[d] = time_eager_step(graph, d, torch_devices, reps, left)
    return calibrate(graph, profile, steps)


def fits_one_step(seconds: float, graph: Graph, profile: Profile, device: str) -> bool:
    """Whether the executor's build, the warm-up and one timed eager step on `device` fit in `seconds`, each step
    expected to take the sum of its ops alone."""
    return (WARMUP + BUILD_STEPS + 1) * sum(eager_alone_times(graph, profile, device)) <= seconds


def profile_calibrated(
    graph: Graph,
    devices: Sequence[str | Device],
    *,
    stores: Sequence[str | Device] = (),
    max_total_s: float | None = None,
    reps: int = REPS,
    **profile_kwargs: Any,
) -> Profile:
    """The graph's profile on `devices` (profile_graph) calibrated back to back on its torch devices: what every
    path that measures a profile calls. Under `max_total_s` the ops get all but SHARE of it (or what they left) and
    the eager steps the rest (measure_back_to_back); the profile's wall_s counts both, back_to_back_s the steps."""
    start = timecap.clock()
    ops_cap = None if max_total_s is None else max_total_s * (1 - SHARE)
    profile = profile_graph(graph, list(devices), stores=list(stores), max_total_s=ops_cap, **profile_kwargs)
    measured = timecap.clock()
    left = None if max_total_s is None else max_total_s - (measured - start)
    profile = measure_back_to_back(graph, profile, reps=reps, within_s=left)
    end = timecap.clock()
    run = {**(profile.profiling or {}), "wall_s": round(end - start, 3), "back_to_back_s": round(end - measured, 3)}
    return replace(profile, profiling={**run, "max_total_s": max_total_s})


def stored_profile(
    graph: Graph, devices: Sequence[str], profile_dir: str | Path | None = None, stores: Sequence[str] = ()
) -> Profile:
    """The graph's stored profile on `devices` and `stores` (pipeline.measured_profile), a fresh one measured and
    calibrated by profile_calibrated: how `wrap` and `xsched train` get their measured costs. A stored one is used
    as it is, so a plan cached on its fingerprint is found again."""
    return measured_profile(graph, devices, profile_dir, stores, measure=profile_calibrated)


def executable_devices(graph: Graph, profile: Profile) -> list[str]:
    """The profile's devices whose eager step the executor can run: torch CPUs and GPUs that run every op."""
    return [
        d
        for d, info in profile.devices.items()
        if info.kind in ("cpu", "cuda")
        and not info.extra.get("simulated")
        and all(op.id in profile.compute.get(d, {}) for op in graph.ops)
    ]
