"""What a plan predicts per step for its computing device, in the columns the GPU benches measure (issue 30): the
step (makespan), forward and backward, the device's compute time and idle time, and the bytes and copy time into
and out of it per direction, from the simulator's overlapped timeline."""

from __future__ import annotations

from typing import Any

from xsched.contracts.graph import Graph
from xsched.contracts.plan import Compute, Copy, Plan
from xsched.contracts.profile import Profile
from xsched.simulate import simulate

# (key, column): the prediction shown beside each measured column of the bench tables
PREDICTED = (
    ("step_s", "predicted step"),
    ("compute_s", "predicted compute"),
    ("copy_in_s", "predicted copies in"),
    ("copy_out_s", "predicted copies out"),
    ("compute_idle_s", "predicted compute idle"),
    ("bytes_in", "predicted bytes in"),
    ("bytes_out", "predicted bytes out"),
)


def plan_traffic(graph: Graph, plan: Plan, profile: Profile, device: str) -> dict[str, Any]:
    """The plan's prediction for one step on `device`: step_s (makespan), forward_s (the steps before the autograd
    boundary end) and backward_s (the rest), compute_s (its computes' costs), compute_idle_s (the makespan less
    compute_s: the time its compute lane waits), and per direction the copies' count, bytes and cost (copies_in,
    bytes_in, copy_in_s: to `device`; copies_out, bytes_out, copy_out_s: from it)."""
    sim = simulate(graph, plan, profile)
    out: dict[str, Any] = {"step_s": sim.makespan_s}
    ends = [end for _, end in sim.step_span[: plan.boundary]] if plan.boundary is not None else []
    out["forward_s"] = max(ends, default=0.0)
    out["backward_s"] = sim.makespan_s - out["forward_s"]
    compute = 0.0
    moved = {"in": [0, 0, 0.0], "out": [0, 0, 0.0]}  # copies, bytes, seconds
    # each step's time is the simulator's (its span: a step runs whole once started), so the compute is priced as
    # the makespan is, calibrated where the profile has a back-to-back model
    for s, (start, end) in zip(plan.steps, sim.step_span, strict=True):
        if isinstance(s, Compute) and s.device == device:
            compute += end - start
        elif isinstance(s, Copy) and device in (s.src, s.dst):
            way = moved["in" if s.dst == device else "out"]
            way[0] += 1
            way[1] += graph.value[s.value].nbytes
            way[2] += end - start
    out["compute_s"] = compute
    out["compute_idle_s"] = max(0.0, sim.makespan_s - compute)
    for way, (count, nbytes, seconds) in moved.items():
        out[f"copies_{way}"], out[f"bytes_{way}"], out[f"copy_{way}_s"] = count, nbytes, seconds
    return out
