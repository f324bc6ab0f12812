"""Fused costs: which ops a fusing compiler absorbs into their consumers, and a profile priced as compiled regions.

Under a fusing compiler (inductor) a pointwise or layer-norm op costs no kernel of its own: it is computed in the
kernel of its consumer, from its inputs, and its output need not exist in memory. So is its recomputation, which is
why recomputing a fusible chain is nearly free (the min-cut partitioner's premise, docs/papers: fusion-aware
checkpointing). `fused_profile` prices a device's ops that way: fusible ops at zero time, and each measured region
(a run of steps compiled as one, `xsched.execute.segments`) at its measured time, shared over its other ops.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from functools import cache
from typing import TYPE_CHECKING

from xsched.contracts.graph import Graph, Op
from xsched.contracts.profile import Profile
from xsched.contracts.random_ops import is_random_target
from xsched.errors import XschedError

if TYPE_CHECKING:
    import torch

REGION_LABEL = "xsched::region:"  # the profiler label of each compiled region's call: REGION_LABEL + "<first>-<last>"

# Not tagged pointwise, but fused by inductor into the kernels around them: normalisations (a row reduction in
# the same kernel), and ops that only rearrange or copy (views, clones, concatenation of small pieces).
FUSIBLE_TARGETS = frozenset(
    {
        "aten.native_layer_norm.default",
        "aten.native_layer_norm_backward.default",
        "aten.clone.default",
        "aten._unsafe_view.default",
        "aten.view.default",
        "aten.t.default",
        "aten.transpose.int",
        "aten.permute.default",
        "aten.expand.default",
        "aten.unsqueeze.default",
        "aten.squeeze.dim",
        "aten.slice.Tensor",
        "aten.select.int",
        "aten.detach.default",
        "aten.empty_like.default",
        "getitem",
    }
)


def _known(target: str) -> bool | None:
    """Whether `target` is fusible where that is known without torch (None: only its tags say)."""
    if target in FUSIBLE_TARGETS:
        return True
    if len(target.split(".")) != 3 or is_random_target(target):  # not a torch op's name, or a draw
        return False
    return None


def needs_torch(graph: Graph) -> bool:
    """Telling the graph's fusible ops apart imports torch (seconds): some op is a torch op outside the table."""
    return any(_known(op.target) is None for op in graph.ops)


@cache
def fusible_target(target: str) -> bool:
    """True for an op inductor computes inside its consumer's kernel: pointwise (torch's `pointwise` tag) or one
    of FUSIBLE_TARGETS, and not random (a draw is an ATen call of its own, and recomputing it needs a replay)."""
    known = _known(target)
    if known is not None:
        return known
    import torch  # here: graphs from other sources (the importers' names) are told apart without it

    from xsched.contracts.torch_ops import resolve

    try:
        fn = resolve(target)
    except XschedError:
        return False
    return torch.Tag.pointwise in getattr(fn, "tags", ())


def fusible(op: Op) -> bool:
    return fusible_target(op.target)


def fused_profile(
    graph: Graph,
    profile: Profile,
    device: str,
    regions: Mapping[tuple[str, ...], float] | None = None,
) -> Profile:
    """`profile` with `device`'s ops priced as compiled: fusible ops at zero time and energy (their work is in their
    consumer's kernel), and each region of `regions` (its ops -> its measured time as compiled, e.g. from
    `region_times`) at that time, shared over its non-fusible ops in proportion to their own times. The device's
    back-to-back calibration is dropped."""
    costs = dict(profile.compute.get(device, {}))
    for op in graph.ops:
        if op.id in costs and fusible(op):
            costs[op.id] = replace(costs[op.id], time_s=0.0, energy_j=0.0)
    for ops, measured in (regions or {}).items():
        heavy = [o for o in dict.fromkeys(ops) if o in costs and not fusible(graph.op[o])]
        total = sum(profile.compute[device][o].time_s for o in heavy)
        for o in heavy:
            share = profile.compute[device][o].time_s / total if total > 0 else 1 / len(heavy)
            old, new = costs[o].time_s, measured * share
            costs[o] = replace(costs[o], time_s=new, energy_j=costs[o].energy_j * new / old if old > 0 else 0.0)
    # a compiled region is neither the eager step the calibration timed nor one launch per op: the times alone
    calibrated = {d: b for d, b in profile.back_to_back.items() if d != device}
    return replace(profile, compute={**profile.compute, device: costs}, back_to_back=calibrated)


def region_times(executor: object, env: Mapping[str, torch.Tensor], runs: int = 3) -> dict[tuple[str, ...], float]:
    """Each compiled region of `executor` (an Executor made with compile=True) -> the ops it computes and its time
    as compiled: the median over `runs` runs of the whole plan (after one that compiles), from the region's
    profiler label (`xsched.execute.segments` marks each call)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from xsched.contracts.plan import Compute

    ex = executor
    ex(env)  # compiles and measures the regions
    cuda = any(d.type == "cuda" for d in ex.dev.values())  # type: ignore[attr-defined]
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    samples: dict[str, list[float]] = {}
    for _ in range(runs):
        with profile(activities=acts) as prof:
            ex(env)
            if cuda:
                torch.cuda.synchronize()
        for e in prof.events():
            if e.name.startswith(REGION_LABEL):  # on CUDA the kernels' time, which the host only launches
                us = max(e.cpu_time_total, e.device_time_total) if cuda else e.cpu_time_total
                samples.setdefault(e.name, []).append(us / 1e6)
    steps = ex.plan.steps  # type: ignore[attr-defined]
    out: dict[tuple[str, ...], float] = {}
    regions = {(r[0], r[-1]): r for r in ex.segments.peaks}  # type: ignore[attr-defined]
    for name, times in samples.items():
        a, b = (int(x) for x in name[len(REGION_LABEL) :].split("-"))
        ops = tuple(steps[i].op for i in regions[(a, b)] if isinstance(steps[i], Compute))
        out[ops] = sorted(times)[len(times) // 2]
    return out
