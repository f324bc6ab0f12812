"""The autograd boundary rule of captured training graphs: `wrap` returns the forward outputs before backward
starts, so each must be resident when the first step that reads a tangent (or runs a backward op) runs. Only the
interval model holds that rule (`intervals/boundary`); this module checks it and repairs plans that break it by
computing the missing outputs earlier, or by holding until the boundary those that are freed before it. The
caller's hold of `graph.held_outputs` from the boundary to the end (`hold_to_end`: those it may release, emptied
and refilled in place, and the rest pinned) the solvers model for the pinned ones (`contracts.holds.pinned_holds`):
the heuristics' timeline (`heuristics/timeline`), the stage MILP (`milp.held`), the interval and hierarchical
models and the memory lower bound. They plan a releasable one as any forward output."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from xsched.contracts.graph import Graph
from xsched.contracts.holds import follow, releasable
from xsched.contracts.plan import Compute, Copy, Free, Plan, Step, autograd_boundary, place_frees
from xsched.errors import PlanError


def forward_outputs(graph: Graph) -> list[str]:
    """The values the wrapped forward returns (captured graphs only; none for imported ones)."""
    refs = graph.forward_outputs or ()
    return [r["ref"] for r in refs if isinstance(r, Mapping) and r.get("ref") in graph.producer]


def missing_at_boundary(graph: Graph, plan: Plan) -> list[str]:
    """Forward outputs not resident on any device when the plan's backward starts."""
    want = forward_outputs(graph)
    b = plan.boundary
    if not want or b is None:
        return []
    resident = set(graph.inputs)
    where: dict[str, set[str]] = {}
    for s in plan.steps[:b]:
        if isinstance(s, Compute):
            for v in graph.op[s.op].outputs:
                where.setdefault(v, set()).add(s.device)
        elif isinstance(s, Copy):
            where.setdefault(s.value, set()).add(s.dst)
        elif isinstance(s, Free):
            where.get(s.value, set()).discard(s.device)
    return [v for v in want if v not in resident and not where.get(v)]


def keep_forward_outputs(graph: Graph, plan: Plan) -> Plan | None:
    """The plan with each missing forward output's first later compute moved to just before the boundary (frees
    placed again after last uses), or None when a moved compute's inputs are not all made before the boundary.
    Memory is not checked here: the caller replays the result in the simulator."""
    missing = missing_at_boundary(graph, plan)
    if not missing:
        return plan
    steps = [s for s in plan.steps if not isinstance(s, Free)]
    b = autograd_boundary(graph, steps)
    assert b is not None
    moved: list[Compute] = []
    for v in missing:
        if any(v in graph.op[s.op].outputs for s in moved):
            continue  # another output of an op already moved
        k = next(
            i for i in range(b, len(steps)) if isinstance(steps[i], Compute) and v in graph.op[steps[i].op].outputs
        )
        moved.append(steps[k])
        steps[k] = None  # type: ignore[call-overload]
    before = [s for s in steps[:b] if s is not None]
    made = set(plan.homes.items())  # (value, device) made before the boundary
    for s in before:
        if isinstance(s, Compute):
            made |= {(v, s.device) for v in graph.op[s.op].outputs}
        elif isinstance(s, Copy):
            made.add((s.value, s.dst))
    for s in moved:
        if any((v, s.device) not in made for v in graph.op[s.op].inputs):
            return None
        made |= {(v, s.device) for v in graph.op[s.op].outputs}
    order = before + moved + [s for s in steps[b:] if s is not None]
    frees = place_frees(graph, order, dict(plan.homes))
    return Plan(
        **{**plan.__dict__, "steps": tuple(frees), "boundary": autograd_boundary(graph, frees), "predicted": None}
    )


def hold_to_boundary(graph: Graph, steps: Sequence[Step]) -> list[Step]:
    """Frees of forward outputs placed before the autograd boundary moved to just after it: the model keeps them
    resident when backward starts (wrap returns them then), but a later recompute of one (it must also exist at
    the end) ends the earlier residency at its last read, which the boundary is not."""
    want = set(forward_outputs(graph))
    b = autograd_boundary(graph, steps)
    if not want or b is None:
        return list(steps)
    out = list(steps)
    held: dict[str, int] = {}  # forward output -> index of its last free before the boundary
    for i, s in enumerate(out[:b]):
        if isinstance(s, Free) and s.value in want:
            held[s.value] = i
        elif isinstance(s, Compute):
            for v in graph.op[s.op].outputs:
                held.pop(v, None)
        elif isinstance(s, Copy):
            held.pop(s.value, None)
    moved = [out[i] for i in sorted(held.values())]
    for i in sorted(held.values(), reverse=True):
        del out[i]
    b -= len(moved)
    return out[: b + 1] + moved + out[b + 1 :]


def hold_to_end(graph: Graph, plan: Plan) -> Plan:
    """The plan as it runs when the caller holds `graph.held_outputs` from the boundary on. Where one is resident
    at the boundary, the caller's storage is there. A releasable one (`contracts.holds`) may be freed there and made
    there again (its storage emptied and refilled in place); one left elsewhere at the end is copied back there. Any
    other free of a held residency releases nothing, and a copy or compute making it there again while it is
    resident makes nothing new: those steps are dropped (the value stays resident, as the simulator then counts it).
    Unchanged where nothing is held or nothing changes."""
    held = set(graph.held_outputs)
    b = plan.boundary
    if not held or b is None:
        return plan
    where: dict[str, set[str]] = {}  # held output -> devices where it is resident (at the boundary, then on)
    for s in plan.steps[:b]:
        follow(graph, s, held, where)
    pinned = {(v, d) for v, ds in where.items() for d in ds}
    free = releasable(graph)
    released: set[tuple[str, str]] = set()
    kept: list[Step] = []
    for s in plan.steps[b:]:
        key = (s.value, s.device) if isinstance(s, Free) else (s.value, s.dst) if isinstance(s, Copy) else None
        if isinstance(s, Free) and key in pinned and s.value in free:
            released.add(key)
        elif isinstance(s, Copy) and key in released:
            released.discard(key)
        elif isinstance(s, Compute) and released.intersection((v, s.device) for v in graph.op[s.op].outputs):
            released.difference_update((v, s.device) for v in graph.op[s.op].outputs)
        elif _remakes_or_frees(graph, s, pinned):
            continue
        kept.append(s)
        follow(graph, s, held, where)
    for v, d in sorted(released):  # left elsewhere at the end: back into the caller's storage
        src = next(iter(sorted(where.get(v, set()) - {d})), None)
        if src is None:
            raise PlanError("a held output is resident nowhere at the end", stage="solve", value=v)
        kept.append(Copy(v, src, d))
    if kept == list(plan.steps[b:]):
        return plan
    steps = (*plan.steps[:b], *kept)
    return Plan(**{**plan.__dict__, "steps": steps, "boundary": autograd_boundary(graph, steps), "predicted": None})


def _remakes_or_frees(graph: Graph, s: Step, pinned: set[tuple[str, str]]) -> bool:
    """`s` frees a pinned residency, or makes only pinned residencies again."""
    if isinstance(s, (Free, Copy)):
        return (s.value, s.device if isinstance(s, Free) else s.dst) in pinned
    return all((v, s.device) in pinned for v in graph.op[s.op].outputs)
