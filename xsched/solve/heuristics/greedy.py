"""The `greedy` heuristic: accelerate's infer_auto_device_map on ops, filling the devices in order."""

from __future__ import annotations

import time

from xsched.budgets import format_bytes
from xsched.contracts.plan import Compute, Plan
from xsched.contracts.result import HeuristicStats
from xsched.errors import BudgetError
from xsched.solve.heuristics.routing import op_workspace, route_and_finish
from xsched.solve.options import DEFAULTS, SolverOptions
from xsched.solve.problem import Problem


def greedy_fill(problem: Problem, options: SolverOptions = DEFAULTS, warm: Plan | None = None) -> Plan:
    """accelerate's infer_auto_device_map on ops: fill the devices in order, moving on when one is full.

    Memory is tracked conservatively while filling (a value stays on every device that holds it until
    its last consumer anywhere), so the final plan, whose frees come after last uses per device,
    never needs more than the tracker saw.
    """
    t0 = time.perf_counter()
    graph, profile, budgets, devices, homes = (
        problem.graph,
        problem.profile,
        problem.budgets,
        problem.devices,
        problem.homes,
    )
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
    stats = HeuristicStats(devices_used=tuple(sorted(set(assignment.values()))))
    return route_and_finish(graph, computes, "greedy", budgets, homes, profile, t0, stats, via=devices)
