"""Routing: a list of computes over devices -> steps with the copies and frees they need, checked by the simulator."""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import replace

from xsched.budgets import format_bytes
from xsched.contracts.graph import Graph
from xsched.contracts.plan import Compute, Copy, Plan, Step, autograd_boundary, place_frees, required_homes
from xsched.contracts.profile import Profile
from xsched.contracts.result import HeuristicStats, SolveResult, Times
from xsched.errors import BudgetError, PlanError
from xsched.simulate import simulate
from xsched.solve.objective import best_of, better

# ---------------------------------------------------------------- routing: computes -> steps with copies and frees


def route(
    graph: Graph,
    computes: Iterable[Compute | Copy],
    homes: Mapping[str, str],
    profile: Profile | None = None,
    *,
    early_home_copies: bool = False,
    via: Sequence[str] = (),
) -> tuple[Step, ...]:
    """Steps running `computes` in order, with the copies their inputs need and frees after last uses.
    Copies among `computes` are kept where they are (a caller's own transfers, e.g. offloading).

    An input not resident on the op's device is copied there right before the op, from the resident
    device with the cheapest link; where no device holding it has a link there, through the cheapest chain
    of links over the devices of `via` (`copy_chain`). Outputs that must end on a param's or buffer's home
    are copied there at the end (or right after they are produced with `early_home_copies`, which frees the
    producing device sooner at the price of holding them longer at home). BudgetError (not found) when no
    chain reaches a device: these computes cannot run on this machine, another plan may.
    """
    where: dict[str, list[str]] = {v: [d] for v, d in homes.items()}
    must_end_on = required_homes(graph, homes)
    steps: list[Step] = []

    def copy_to(v: str, dst: str, op: str | None) -> None:
        if v not in where:
            raise PlanError("value is read before any step produces it", stage="solve", op=op, value=v, device=dst)
        for src, to in copy_chain(v, where[v], dst, graph, profile, via, op):
            steps.append(Copy(v, src, to))
            where[v].append(to)

    for c in computes:
        if isinstance(c, Copy):
            steps.append(c)
            where.setdefault(c.value, []).append(c.dst)
            continue
        op = graph.op[c.op]
        for v in dict.fromkeys(op.inputs):
            if c.device not in where.get(v, ()):
                copy_to(v, c.device, op.id)
        steps.append(c)
        for v in op.outputs:
            on = where.setdefault(v, [])
            if c.device not in on:
                on.append(c.device)
            if early_home_copies and must_end_on.get(v, c.device) not in on:
                copy_to(v, must_end_on[v], op.id)
    for v, home in must_end_on.items():
        if home not in where.get(v, ()):
            copy_to(v, home, graph.producer.get(v))
    return place_frees(graph, steps, homes)


def home_copies_early(graph: Graph, steps: Sequence[Step], device: str, homes: Mapping[str, str]) -> tuple[Step, ...]:
    """`steps` with each copy of an output from `device` to the device it must end on (a gradient to its parameter's
    home) moved up to right after the step that last made the value on `device` before it (in the backward); frees
    stay where they are. route emits these copies at the end, and a copy lane runs in plan order behind every free
    before it on the destination (xsched.lanes): queued there, they all wait for the plan's last copy back and its
    store free, and run in a tail after the last compute; issued as each value is made, they overlap the computes
    after it."""
    must_end = required_homes(graph, homes)
    # never into the forward: wrap runs the steps before the boundary's step in its forward (a buffer's update is
    # made there), so a copy goes after that step at the earliest
    boundary = autograd_boundary(graph, steps)
    first = boundary if boundary is not None else -1
    made: dict[str, int] = {}  # value -> index of the latest step that made it on `device`
    moved: dict[int, list[Step]] = {}  # index of a making step -> the copies home to issue right after it
    keep: list[Step | None] = list(steps)
    for i, s in enumerate(steps):
        if isinstance(s, Compute) and s.device == device:
            made.update((v, i) for v in graph.op[s.op].outputs)
        elif isinstance(s, Copy) and s.dst == device:
            made[s.value] = i
        elif isinstance(s, Copy) and s.src == device and must_end.get(s.value) == s.dst and s.value in made:
            if (at := max(made[s.value], first)) < i - 1:
                moved.setdefault(at, []).append(s)
                keep[i] = None
    out: list[Step] = []
    for i, s in enumerate(keep):
        if s is not None:
            out.append(s)
        out.extend(moved.get(i, ()))
    return tuple(out)


def home_copies_issued_early(graph: Graph, steps: Sequence[Step], homes: Mapping[str, str]) -> tuple[Step, ...]:
    """home_copies_early for every device that computes in `steps`: each copy home from a device issued right after
    the value was last made there."""
    steps = tuple(steps)
    for d in dict.fromkeys(s.device for s in steps if isinstance(s, Compute)):
        steps = home_copies_early(graph, steps, d, homes)
    return steps


def copy_chain(
    v: str, held: Sequence[str], dst: str, graph: Graph, profile: Profile | None, via: Sequence[str], op: str | None
) -> list[tuple[str, str]]:
    """The copies (src, dst) that bring `v` to `dst`: one from the device in `held` with the cheapest link there;
    where none has a link, the chain of links through devices of `via` that takes the least time (a direct copy is
    kept even where a chain would be faster: it holds no relay's memory and one link's time). BudgetError naming
    the value and the devices when no chain exists."""
    if profile is None:
        return [(held[0], dst)]
    nbytes = graph.value[v].nbytes
    times = [(t, d) for d in held if (t := profile.copy_time(v, nbytes, d, dst)) is not None]
    if times:
        return [(min(times)[1], dst)]
    # Dijkstra from every holder at once over the relays; ties go to fewer hops, then the first device named
    order = {d: k for k, d in enumerate((*held, *via))}
    heap = [(0.0, 0, order[d], d, (d,)) for d in held]
    done: set[str] = set()
    while heap:
        t, hops, _, d, path = heapq.heappop(heap)
        if d == dst:
            return list(zip(path, path[1:], strict=False))
        if d in done:
            continue
        done.add(d)
        for e in (*via, dst):
            if e not in done and (ct := profile.copy_time(v, nbytes, d, e)) is not None:
                heapq.heappush(heap, (t + ct, hops + 1, order.get(e, len(order)), e, (*path, e)))
    relays = [d for d in dict.fromkeys(via) if d not in held and d != dst]
    raise BudgetError(
        f"not found: no copy link brings {v} from {', '.join(held)} to {dst} in the profile, nor a chain of links "
        + (f"through {', '.join(relays)}" if relays else "(no other device to relay it)"),
        stage="solve",
        op=op,
        value=v,
        device=dst,
    )


def insert_copies(
    graph: Graph, assignment: Mapping[str, str], homes: Mapping[str, str], profile: Profile | None = None
) -> tuple[Step, ...]:
    """Every op once, in graph order, on its assigned device, with the copies and frees that needs."""
    missing = [o.id for o in graph.ops if o.id not in assignment]
    if missing:
        raise PlanError(f"{len(missing)} ops have no device in the assignment", stage="solve", op=missing[0])
    return route(graph, (Compute(o.id, assignment[o.id]) for o in graph.ops), homes, profile)


def finish(
    graph: Graph,
    steps: Sequence[Step],
    name: str,
    budgets: Mapping[str, int],
    homes: Mapping[str, str],
    profile: Profile | None,
    started: float,
    *,
    lanes: bool = True,
    stats: HeuristicStats | None = None,
) -> Plan:
    """Wrap steps in a Plan, check it with the simulator and attach its predicted figures (without `lanes`, no
    makespan: a search that only asks whether a plan fits skips the lanes' timing). `stats`: the heuristic's
    choices.

    Over a budget is a BudgetError naming the device, its peak and the step where the peak is reached.
    """
    plan = Plan(
        graph=graph.fingerprint,
        budgets=dict(budgets),
        homes=dict(homes),
        steps=tuple(steps),
        solver=SolveResult(name, "heuristic", stats=stats or HeuristicStats()),
        boundary=autograd_boundary(graph, steps),
    )
    result = simulate(graph, plan, profile, check_budgets=False, lanes=lanes)
    for d, budget in budgets.items():
        peak = result.peak_bytes.get(d, 0)
        if peak > budget:
            i = result.peak_step[d]
            s = plan.steps[i] if i >= 0 else None
            op = s.op if isinstance(s, Compute) else graph.producer.get(s.value) if isinstance(s, Copy) else None
            what = f"compute of {op}" if isinstance(s, Compute) else f"copy of {s.value}" if s else "the homed inputs"
            raise BudgetError(
                f"{name} plan peaks at {format_bytes(peak)} on {d} (budget {format_bytes(budget)}) at step {i}, {what}",
                stage="solve",
                device=d,
                op=op,
            )
    solver = replace(plan.solver, times=Times(solve_s=time.perf_counter() - started))
    return replace(plan, solver=solver, predicted=result.prediction())


def route_and_finish(
    graph: Graph,
    computes: Iterable[Compute | Copy],
    name: str,
    budgets: Mapping[str, int],
    homes: Mapping[str, str],
    profile: Profile | None,
    started: float,
    stats: HeuristicStats | None = None,
    via: Sequence[str] = (),
) -> Plan:
    """finish_with_early_homes(route(...)); when that is over budget, retry with home copies right after
    production. `via`: the devices a copy may pass through where no link is direct (route)."""
    computes = list(computes)
    try:
        steps = route(graph, computes, homes, profile, via=via)
        return finish_with_early_homes(graph, steps, name, budgets, homes, profile, started, stats=stats)
    except BudgetError:
        if not required_homes(graph, homes):
            raise
        early = route(graph, computes, homes, profile, early_home_copies=True, via=via)
        return finish(graph, early, name, budgets, homes, profile, started, stats=stats)


def finish_with_early_homes(
    graph: Graph,
    steps: Sequence[Step],
    name: str,
    budgets: Mapping[str, int],
    homes: Mapping[str, str],
    profile: Profile | None,
    started: float,
    *,
    stats: HeuristicStats | None = None,
) -> Plan:
    """finish(steps), or the same steps with their copies home issued as their values are made
    (home_copies_issued_early) where that plan fits the budgets and is better (objective.better). route leaves
    those copies at the end, where each waits for every earlier free on its home (xsched.lanes) and they can run in
    a tail after the last compute; early, they overlap the computes, but hold their values on their homes longer.
    One more simulation, only where a copy moves."""

    def again(moved: Sequence[Step]) -> Plan:
        return finish(graph, moved, name, budgets, homes, profile, started, stats=stats)

    return with_early_homes(graph, again(steps), homes, profile, again)


def with_early_homes(
    graph: Graph,
    plan: Plan,
    homes: Mapping[str, str],
    profile: Profile | None,
    check: Callable[[Sequence[Step]], Plan],
) -> Plan:
    """`plan`, or `check(steps)` of its steps with their copies home issued early (home_copies_issued_early) where
    that fits (`check` raises BudgetError where not) and is better (objective.better): finish_with_early_homes for
    any maker of checked plans (hier's flattened plans too)."""
    if profile is None:  # untimed: no makespan to gain
        return plan
    early = home_copies_issued_early(graph, plan.steps, homes)
    if early == plan.steps:
        return plan
    try:
        moved = check(early)
    except BudgetError:  # the values held longer on their homes overfill one: the copies stay at the end
        return plan
    return moved if better(moved, plan) else plan


def best_single_device(
    build: Callable[[str], Plan],
    graph: Graph,
    profile: Profile | None,
    devices: Sequence[str],
    name: str,
    alpha_energy: float = 0.0,
) -> Plan:
    """The best plan `build(device)` (objective.better) over the devices that can run every op; BudgetError if none
    fits."""
    plans: list[Plan] = []
    failures: list[str] = []
    for d in devices:
        if profile is not None and not all(profile.can_run(o.id, d) for o in graph.ops):
            failures.append(f"{d}: cannot run every op")
            continue
        try:
            plans.append(build(d))
        except BudgetError as e:
            failures.append(f"{d}: {e.detail}")
    if not plans:
        raise BudgetError(
            f"no single device can hold the {name} plan: " + "; ".join(failures),
            stage="solve",
            device=devices[0] if devices else None,
        )
    return best_of(plans, alpha_energy)


def op_workspace(op, device: str, profile: Profile | None) -> int:
    cost = profile.op_cost(op.id, device) if profile is not None else None
    return max(op.workspace_bytes, cost.workspace_bytes if cost else 0)
