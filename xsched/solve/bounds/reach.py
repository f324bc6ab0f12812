"""Where a value can be at all over the profile's copy links, whatever the budgets: the check that no plan exists
when no device that runs an op can get all its inputs, or an output cannot reach the device it must end on."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

from xsched.contracts.graph import Graph
from xsched.contracts.plan import required_homes
from xsched.contracts.profile import Profile
from xsched.errors import NoLinkError


def reachable(profile: Profile, starts: Collection[str], devices: Sequence[str]) -> set[str]:
    """The devices of `devices` that a value on any of `starts` can be copied to, link after link through devices
    of `devices` (the starts included)."""
    seen, todo = set(starts), list(starts)
    while todo:
        d = todo.pop()
        for e in devices:
            if e not in seen and profile.link(d, e) is not None:
                seen.add(e)
                todo.append(e)
    return seen


def check_reach(graph: Graph, profile: Profile | None, devices: Sequence[str], homes: Mapping[str, str]) -> None:
    """NoLinkError (a BudgetError), proven, when no plan can run some op or end some output where it must: every
    plan runs each op on a device that holds all its inputs, and a value is only where a compute made it or a chain
    of copies brought it. So where each value can be is found in graph order: an input anywhere its home reaches; an op's
    outputs anywhere reached from the devices that run it and can hold its inputs; no such device, or a required
    home out of reach, leaves no plan. Budgets play no part. An input without a home may be anywhere."""
    if profile is None:
        return
    where: dict[str, set[str]] = {
        v: reachable(profile, (homes[v],), devices) if v in homes else set(devices) for v in graph.inputs
    }
    for op in graph.ops:
        can = [d for d in devices if profile.can_run(op.id, d)]
        hold = [d for d in can if all(d in where[v] for v in op.inputs)]
        if not hold:
            # an input that reaches none of them, else no one of them gets them all
            v = next((v for v in op.inputs if not where[v].intersection(can)), None)
            brings = f"its input {v}" if v is not None else "all its inputs to any one of them"
            raise NoLinkError(
                f"op {op.id} runs only on {', '.join(can)}, and no copy link or chain of links among "
                f"{', '.join(devices)} brings {brings}: no plan can run it",
                stage="solve",
                op=op.id,
                value=v,
            )
        reach = reachable(profile, hold, devices)
        for v in op.outputs:
            where[v] = reach
    for v, home in required_homes(graph, homes).items():
        if home not in where[v]:
            raise NoLinkError(
                f"{v} must end on {home}, but no copy link or chain of links among {', '.join(devices)} brings it "
                f"there from where it can be made: no plan can end it there",
                stage="solve",
                value=v,
                device=home,
            )
