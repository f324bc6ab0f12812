"""What the optimizer split by time is decided from: the all-home plan's predicted run (when its backward releases
each parameter, when its forward first reads it) in groups of parameters consecutive in the release order, and
AdamW's rate measured on the host and on the computing device."""

from __future__ import annotations

import time

import torch

from xsched.contracts.graph import Graph
from xsched.contracts.plan import Plan
from xsched.contracts.profile import Profile
from xsched.execute.param_home import ListenerSlot, ParamPoints
from xsched.execute.reference import torch_device
from xsched.simulate import simulate
from xsched.train.host_buckets import adamw_step, make_bucket, sq_norm
from xsched.train.placement import numel, state_bytes
from xsched.train.split_time import Group

MAX_GROUPS = 24  # the split's search evaluates O(groups^3) predictions per exchange round


def plan_groups(
    graph: Graph, plan: Plan, profile: Profile, max_groups: int = MAX_GROUPS, home: str | None = None
) -> tuple[list[Group], float]:
    """The plan's parameters in at most `max_groups` groups (consecutive in its release order, of about equal
    size), each with the time its last gradient is released and the time its first weight is read, and the
    plan's predicted run (makespan, s). `home`: only the parameters homed there (those a split left to the host's
    optimizer; the moved ones are updated on the computing device)."""
    sim = simulate(graph, plan, profile)
    spans, run_s = sim.step_span, float(sim.makespan_s or 0.0)
    points = ParamPoints(graph, plan, ListenerSlot())
    vid = {graph.value[v].name: v for v in graph.inputs if graph.value[v].kind == "param"}
    if home is not None:
        vid = {n: v for n, v in vid.items() if plan.homes.get(v) == home}
    release = dict.fromkeys(points.order, run_s if not spans else 0.0)
    for i, names in points.marks.items():
        for n in names:
            if n in release:
                release[n] = max(release[n], spans[i][1] if spans else run_s)
    for n in points.at_end:
        release[n] = run_s
    read = dict.fromkeys(points.order, 0.0)
    for i, n in sorted(points.reads.items(), reverse=True):
        if n in read:
            read[n] = spans[i][0] if spans else 0.0
    order = [n for n in points.order if n in vid]
    total = sum(graph.value[vid[n]].nbytes for n in order)
    target = max(1, -(-total // max_groups))
    groups, members, size = [], [], 0
    for n in order:
        members.append(n)
        size += graph.value[vid[n]].nbytes
        if size >= target:
            groups.append(_group(graph, vid, members, release, read))
            members, size = [], 0
    if members:
        groups.append(_group(graph, vid, members, release, read))
    return groups, run_s


def _group(graph: Graph, vid: dict[str, str], names: list[str], release: dict, read: dict) -> Group:
    ids = tuple(vid[n] for n in names)
    count = sum(numel(graph.value[v].shape or ()) for v in ids)
    moved = sum(2 * graph.value[v].nbytes + state_bytes(graph, v) for v in ids)
    return Group(ids, count, moved, max(release[n] for n in names), min(read[n] for n in names))


def adamw_rate(device: str, numel: int = 1 << 23, reps: int = 3) -> float:
    """AdamW's rate (parameters/s) on `device`, as HostAdamW runs it: the gradient's norm (on the host) and one
    fused step over a flat buffer of `numel` fp32 values, a bucket's size (a smaller one would sit in the host's
    cache); the best of `reps` after one warm-up."""
    dev = torch_device(device)
    p = torch.nn.Parameter(torch.zeros(numel, device=dev))
    bucket = make_bucket(0, [("p", p)], {"p": 0.01}, 1e-3, separate=False)
    seg = bucket.segments[0]
    seg.grad.normal_()
    best = float("inf")
    for k in range(reps + 1):
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        if dev.type == "cpu":
            sq_norm(seg.grad)
        adamw_step(bucket.segments, 1e-3)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        if k:
            best = min(best, time.perf_counter() - t0)
    return numel / best
