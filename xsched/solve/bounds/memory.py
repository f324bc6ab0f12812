"""Memory lower bounds per device, and the infeasibility check that runs before any solver."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from xsched.budgets import format_bytes
from xsched.contracts.graph import Graph, Op
from xsched.contracts.holds import pinned_holds
from xsched.contracts.plan import ends_on_one_device, required_homes
from xsched.contracts.profile import Profile
from xsched.errors import BudgetError, ProfileError
from xsched.solve.bounds.crossing import crossing_bound
from xsched.solve.bounds.reach import check_reach


@dataclass(frozen=True)
class Bound:
    """No valid plan peaks below `bytes` on a device; `op` (if any) and `reason` say what sets it, `by` which bound
    it is: "homed" (inputs and end outputs), "gradients" (`_last_output`), "crossing", "held" (`_held_through_backward`)
    or "op" (an op only it runs)."""

    bytes: int
    op: str | None
    reason: str
    by: str = "homed"


def runnable_on(graph: Graph, profile: Profile | None, devices: Sequence[str]) -> dict[str, list[str]]:
    """op id -> the devices (of `devices`) it can run on; a profile without an entry means it cannot."""
    return {o.id: [d for d in devices if profile is None or profile.can_run(o.id, d)] for o in graph.ops}


def op_need(graph: Graph, op: Op, device: str, homes: Mapping[str, str], profile: Profile | None) -> int:
    """Bytes op needs on `device` on top of the inputs homed there: its other inputs, outputs and workspace."""
    cost = profile.op_cost(op.id, device) if profile is not None else None
    workspace = max(op.workspace_bytes, cost.workspace_bytes if cost else 0)
    own = set(op.inputs) | set(op.outputs)
    return sum(graph.value[v].nbytes for v in own if homes.get(v) != device) + workspace


def _homed(graph: Graph, homes: Mapping[str, str], device: str) -> int:
    return sum(graph.value[v].nbytes for v, d in homes.items() if d == device)


def lower_bounds(
    graph: Graph, profile: Profile | None, devices: Sequence[str], homes: Mapping[str, str]
) -> dict[str, Bound]:
    """Per device: the inputs homed there (never freed) plus the largest of (a) the outputs that must
    end there, held while the last of them is made (`_last_output`), (b) with one device, what is held while the
    last of its heaviest ops runs (`crossing.crossing_bound`), (c) with one device, a backward op's need beside the
    outputs the caller holds (`_held_through_backward`), and (d) the biggest need of an op that can run only there."""
    where = runnable_on(graph, profile, devices)
    end_on = required_homes(graph, homes)
    bounds: dict[str, Bound] = {}
    for d in devices:
        homed = _homed(graph, homes, d)
        base = f"{format_bytes(homed)} of graph inputs homed on {d}"
        ending = sum(graph.value[v].nbytes for v, h in end_on.items() if h == d)
        best = Bound(
            homed + ending, None, base + (f" + {format_bytes(ending)} of outputs that must end there" if ending else "")
        )
        if len(devices) == 1 and ending:
            held, op = _last_output(graph, profile, d, homes, end_on)
            if homed + held > best.bytes:
                why = (
                    f"{base} + {format_bytes(held)} while the outputs that must end there are made: whichever is "
                    f"made last, the others are held while its op runs (at best op {op}'s)"
                )
                best = Bound(homed + held, op, why, "gradients")
        needs = {op.id: op_need(graph, op, d, homes, profile) for op in graph.ops}
        if len(devices) == 1:
            crossing = crossing_bound(graph, needs, d, homes, ends_on_one_device(graph, homes), best.bytes - homed)
            if crossing is not None:
                op = graph.op[crossing.op]
                why = (
                    f"{base} + {format_bytes(crossing.bytes)} while the last of the {crossing.heavy} ops needing at "
                    f"least {format_bytes(crossing.need)} runs: its need, and what later outputs read that no such "
                    f"op can make again (at best op {op.id}, {op.name or op.target})"
                )
                best = Bound(homed + crossing.bytes, op.id, why, "crossing")
        held = _held_through_backward(graph, needs, homes) if len(devices) == 1 else None
        if held is not None and homed + held[0] > best.bytes:
            why = (
                f"{base} + {format_bytes(held[0])} while backward op {held[1]} runs beside the forward outputs the "
                "caller holds from the autograd boundary to the end"
            )
            best = Bound(homed + held[0], held[1], why, "held")
        for op in graph.ops:
            if where[op.id] != [d]:
                continue
            need = needs[op.id]
            if homed + need > best.bytes:
                why = f"{base} + {format_bytes(need)} for op {op.id} ({op.name or op.target}: inputs, outputs, workspace), which can run only on {d}"
                best = Bound(homed + need, op.id, why, "op")
        bounds[d] = best
    return bounds


def _held_through_backward(graph: Graph, needs: Mapping[str, int], homes: Mapping[str, str]) -> tuple[int, str] | None:
    """With one device, the most bytes (beyond homed inputs) a backward op needs beside the held outputs it neither
    reads nor makes, and that op; None when nothing is held. A held forward output must be resident when backward
    starts (the boundary rule) and the caller keeps it from then to the end, so every backward op runs beside it."""
    refs = {r.get("ref") for r in graph.forward_outputs or () if isinstance(r, Mapping)}
    held = [v for v in pinned_holds(graph) if v in refs and v not in homes]
    if not held:
        return None
    tangents = {v.id for v in graph.values if v.kind == "tangent"}
    best: tuple[int, str] | None = None
    for op in graph.ops:
        if op.phase != "bwd" and not tangents.intersection(op.inputs):
            continue
        own = set(op.inputs) | set(op.outputs)
        need = needs[op.id] + sum(graph.value[v].nbytes for v in held if v not in own)
        if best is None or need > best[0]:
            best = (need, op.id)
    return best


def _last_output(
    graph: Graph, profile: Profile | None, device: str, homes: Mapping[str, str], end_on: Mapping[str, str]
) -> tuple[int, str]:
    """The least bytes (beyond homed inputs) one device holds while its end-resident outputs are made, and the
    producer of the last in that order.

    Each such output o is resident from one making (the one that starts its last residency) to the end, so when
    o's producer makes it that time, every output whose last residency started before is held too, beside that
    op's own need: e_o, its need less the end-resident values among its inputs and outputs (counted apart, as if
    already held: this keeps the bound sound).
    With only this device no copy can bring o instead. Over the orders of those makings, the largest (outputs made
    so far + e of the one being made) is least when the outputs are made in decreasing e (swapping two neighbours
    out of that order never lowers the larger of their two terms)."""
    items = []
    for v, h in end_on.items():
        if h != device:
            continue
        if v not in graph.producer:  # a graph input passed through: no op makes it
            items.append((0, graph.value[v].nbytes, ""))
            continue
        op = graph.ops[graph.op_index[graph.producer[v]]]
        own = set(op.inputs) | set(op.outputs)
        held = sum(graph.value[u].nbytes for u in own if end_on.get(u) == device and homes.get(u) != device)
        items.append((op_need(graph, op, device, homes, profile) - held, graph.value[v].nbytes, op.id))
    items.sort(key=lambda x: -x[0])
    made, best, who = 0, 0, ""
    for extra, size, op_id in items:
        made += size
        if made + extra > best:
            best, who = made + extra, op_id
    return best, who


def check_budgets(
    graph: Graph,
    profile: Profile | None,
    budgets: Mapping[str, int],
    devices: Sequence[str],
    homes: Mapping[str, str],
) -> None:
    """Raise BudgetError when no plan can meet the budgets (necessary conditions only), or when no plan exists at
    all over the profile's copy links (`reach.check_reach`).

    The message names the device, the bound in human units and the op that sets it; when no
    device can run some op, it lists for each device the smallest budget that op needs there.
    """
    for v, d in homes.items():
        if d not in devices:
            raise BudgetError(
                f"graph input is homed on {d}, which is not among the devices {list(devices)}",
                stage="solve",
                value=v,
                device=d,
            )
    where = runnable_on(graph, profile, devices)
    for op in graph.ops:
        if not where[op.id]:
            raise ProfileError(
                f"op cannot run on any of {', '.join(devices)} (no cost in the profile)", stage="solve", op=op.id
            )
    check_reach(graph, profile, devices, homes)  # an op whose inputs cannot meet, an output that cannot get home
    bounds = lower_bounds(graph, profile, devices, homes)
    for d, b in bounds.items():
        if d in budgets and b.bytes > budgets[d]:
            raise BudgetError(
                f"budget {format_bytes(budgets[d])} on {d} is below the lower bound {format_bytes(b.bytes)}: {b.reason}. "
                + _all_bounds(bounds, budgets),
                stage="solve",
                device=d,
                op=b.op,
            )
    for op in graph.ops:
        needs = {d: _homed(graph, homes, d) + op_need(graph, op, d, homes, profile) for d in where[op.id]}
        if any(d not in budgets or n <= budgets[d] for d, n in needs.items()):
            continue
        per_device = "; ".join(
            f"{d} needs at least {format_bytes(needs[d])} (has {format_bytes(budgets[d])}): homed inputs + op {op.id}'s inputs, outputs and workspace"
            if d in needs
            else f"{d} cannot run op {op.id}"
            for d in devices
        )
        tightest = min(needs, key=lambda d: needs[d] - budgets[d])
        raise BudgetError(
            f"no device can run op {op.id} ({op.name or op.target}) within its budget: {per_device}",
            stage="solve",
            op=op.id,
            device=tightest,
        )


def _all_bounds(bounds: Mapping[str, Bound], budgets: Mapping[str, int]) -> str:
    parts = []
    for d, b in bounds.items():
        has = f"has {format_bytes(budgets[d])}" if d in budgets else "unlimited"
        parts.append(f"{d} needs at least {format_bytes(b.bytes)} ({has}; set by {b.op or 'homed inputs/outputs'})")
    return "Smallest budgets that could work: " + "; ".join(parts)
