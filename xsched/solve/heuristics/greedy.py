"""Baseline plans and MILP warm starts: single-device eager, greedy fill, fastest device, checkpointing, gaps.

Every function returns a `Plan` that `simulate` accepted under its budgets, or raises `BudgetError`
naming the device and the op where the heuristic ran out of memory.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence

from xsched.budgets import format_bytes
from xsched.contracts.graph import Graph
from xsched.contracts.plan import Compute, Plan
from xsched.contracts.profile import Profile
from xsched.errors import BudgetError, XschedError
from xsched.solve.heuristics.checkpoint import checkpoint_search, sqrt_checkpoint
from xsched.solve.heuristics.gaps import gap_remat
from xsched.solve.heuristics.offload import offload_search
from xsched.solve.heuristics.park import park_remat
from xsched.solve.heuristics.routing import best_single_device, op_workspace, route_and_finish
from xsched.solve.objective import best_of
from xsched.solve.problem import runnable

# ---------------------------------------------------------------- baselines


def eager(
    graph: Graph, profile: Profile | None, budgets: Mapping[str, int], devices: Sequence[str], homes: Mapping[str, str]
) -> Plan:
    """The eager schedule on each single device (inputs copied in from their homes); the fastest that fits."""

    def on(d: str) -> Plan:
        t0 = time.perf_counter()
        return route_and_finish(
            graph, (Compute(o.id, d) for o in graph.ops), "eager", budgets, homes, profile, t0, device=d
        )

    return best_single_device(on, graph, profile, devices, "eager")


def greedy_fill(
    graph: Graph, profile: Profile | None, budgets: Mapping[str, int], devices: Sequence[str], homes: Mapping[str, str]
) -> Plan:
    """accelerate's infer_auto_device_map on ops: fill the devices in order, moving on when one is full.

    Memory is tracked conservatively while filling (a value stays on every device that holds it until
    its last consumer anywhere), so the final plan, whose frees come after last uses per device,
    never needs more than the tracker saw.
    """
    t0 = time.perf_counter()
    nbytes = {v.id: v.nbytes for v in graph.values}
    last_use = {v: graph.op_index[c[-1]] for v, c in graph.consumers.items() if c}
    keep = set(graph.outputs)
    held: dict[str, set[str]] = {d: set() for d in devices}
    used = dict.fromkeys(devices, 0)
    for v, d in homes.items():
        held.setdefault(d, set()).add(v)
        used[d] = used.get(d, 0) + nbytes[v]
    full: set[str] = set()
    assignment: dict[str, str] = {}
    for i, op in enumerate(graph.ops):
        ins = set(op.inputs)
        for d in devices:
            if d in full or (profile is not None and not profile.can_run(op.id, d)):
                continue
            need = (
                sum(nbytes[v] for v in ins - held[d])
                + sum(nbytes[v] for v in op.outputs)
                + op_workspace(op, d, profile)
            )
            if d not in budgets or used[d] + need <= budgets[d]:
                break
            full.add(d)  # accelerate never goes back to a device once the next one has started
        else:
            runnable = [d for d in devices if profile is None or profile.can_run(op.id, d)]
            raise BudgetError(
                f"greedy fill ran out of devices at op {op.id}: "
                + ", ".join(
                    f"{d} holds {format_bytes(used[d])} of {format_bytes(budgets.get(d, 0))}" for d in runnable
                ),
                stage="solve",
                op=op.id,
                device=runnable[-1] if runnable else None,
            )
        assignment[op.id] = d
        for v in (ins - held[d]) | set(op.outputs):
            held[d].add(v)
            used[d] += nbytes[v]
        for v in ins | set(op.outputs):
            if v not in keep and last_use.get(v, -1) <= i:
                for e in devices:
                    if v in held[e] and homes.get(v) != e:
                        held[e].discard(v)
                        used[e] -= nbytes[v]
    computes = [Compute(o.id, assignment[o.id]) for o in graph.ops]
    return route_and_finish(
        graph, computes, "greedy", budgets, homes, profile, t0, devices_used=sorted(set(assignment.values()))
    )


def fastest(
    graph: Graph, profile: Profile, budgets: Mapping[str, int], devices: Sequence[str], homes: Mapping[str, str]
) -> Plan:
    """Each op on the device where it runs fastest, ignoring copies; then the copies it needs."""
    t0 = time.perf_counter()
    assignment = {}
    for op in graph.ops:
        times = [(c.time_s, k, d) for k, d in enumerate(devices) if (c := profile.op_cost(op.id, d)) is not None]
        if not times:
            raise BudgetError(f"op cannot run on any of {', '.join(devices)}", stage="solve", op=op.id)
        assignment[op.id] = min(times)[2]
    computes = [Compute(o.id, assignment[o.id]) for o in graph.ops]
    return route_and_finish(graph, computes, "fastest", budgets, homes, profile, t0)


HEURISTICS: dict[str, Callable[..., Plan]] = {
    "eager": eager,
    "greedy": greedy_fill,
    "fastest": fastest,
    "sqrt": sqrt_checkpoint,
    "checkpoint": checkpoint_search,
    "offload": offload_search,
    "gaps": gap_remat,
    "park": park_remat,
}


def best_heuristic(
    graph: Graph, profile: Profile, budgets: Mapping[str, int], devices: Sequence[str], homes: Mapping[str, str]
) -> tuple[Plan | None, dict[str, str]]:
    """The fastest plan among all heuristics that meet the budgets and that `wrap` can run (forward outputs resident
    at the autograd boundary, repaired where the budgets allow), and why each other one failed."""
    plans, why = [], {}
    for name, fn in HEURISTICS.items():
        try:
            plans.append(runnable(graph, fn(graph, profile, budgets, devices, homes), profile, budgets))
        except XschedError as e:
            why[name] = e.detail
    best = best_of(plans)
    return best, why
