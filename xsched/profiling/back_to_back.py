"""The back-to-back calibration of a profile: fit each device's per-op launch overhead to its measured eager step."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

from xsched.contracts.graph import Graph
from xsched.contracts.profile import BackToBack, Profile
from xsched.errors import ProfileError


def step_time(times: Sequence[float], overhead_s: float) -> float:
    """The model's back-to-back step: each op pays max(kernel, overhead), never more than alone (BackToBack.time)."""
    b = BackToBack(0.0, 0.0, overhead_s)
    return sum(b.time(t) for t in times)


def fit_overhead(times: Sequence[float], step_s: float) -> float:
    """The smallest overhead whose modelled step is `step_s`: negative (each op pays the same extra) when the ops
    back to back are slower than alone, the best fit when no overhead makes them as fast as measured.

    The modelled step is piecewise linear in the overhead, with its breaks at each t and t / 2, so the root is
    found exactly on the first segment that crosses step_s."""
    if not times:
        return 0.0
    alone = sum(times)
    if alone <= step_s:
        return -(step_s - alone) / len(times)
    breaks = sorted({0.0, *times, *(t / 2 for t in times)})
    prev, f_prev = breaks[0], step_time(times, breaks[0])
    for b in breaks[1:]:
        f_b = step_time(times, b)
        if f_b <= step_s:
            return prev + (b - prev) * (f_prev - step_s) / (f_prev - f_b)
        prev, f_prev = b, f_b
    return min(breaks, key=lambda b: step_time(times, b))


def eager_alone_times(graph: Graph, profile: Profile, device: str) -> list[float]:
    """Each op's profiled time alone on `device`, in graph order: the eager step that the calibration measures."""
    costs = profile.compute.get(device, {})
    missing = [op.id for op in graph.ops if op.id not in costs]
    if missing:
        raise ProfileError(
            f"{len(missing)} ops cannot run on {device}: no eager step there", op=missing[0], device=device
        )
    return [costs[op.id].time_s for op in graph.ops]


def calibrate(graph: Graph, profile: Profile, steps: Mapping[str, float]) -> Profile:
    """`profile` with each device of `steps` (device -> its measured back-to-back eager step, seconds) calibrated."""
    profile.check_graph(graph.fingerprint)
    calibrated = dict(profile.back_to_back)
    for device, step_s in steps.items():
        times = eager_alone_times(graph, profile, device)
        calibrated[device] = BackToBack(step_s, sum(times), fit_overhead(times, step_s))
    return replace(profile, back_to_back=calibrated)
