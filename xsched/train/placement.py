"""Where each parameter's optimizer lives (ZeRO-Offload++'s "Twin-Flow" split): the parameters the backward finishes
last, whose host update the next forward would wait for first, are homed on the computing device with their
gradients, AdamW state and master weights, within a share of its budget; the rest stay on the parameters' home (the
host), streamed in and updated there. The plan is then solved with those homes and the compute budget less the
optimizer state it cannot see (the graph holds weights and gradients, not AdamW's moments)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from xsched.budgets import parse_budget
from xsched.contracts.graph import Graph
from xsched.errors import BudgetError, XschedError
from xsched.train.split_time import Group, StepModel, choose_groups

# bytes beside the weights and gradients per parameter whose update runs on the computing device: AdamW's two fp32
# moments, and for low-precision weights their fp32 master and fp32 gradient buffer
STATE_BYTES = {4: 8, 2: 16}


@dataclass(frozen=True)
class Split:
    """The parameters (graph input ids) homed on `device` with their optimizer, the bytes they and their state take
    there, and the budgets the plan is solved within (the compute budget less the state)."""

    device: str
    params: tuple[str, ...]
    bytes: int
    state_bytes: int
    budgets: Mapping[str, str | int]


def state_bytes(graph: Graph, vid: str) -> int:
    """The optimizer's bytes for parameter `vid` beside its weight and gradient."""
    v = graph.value[vid]
    n = numel(v.shape or ())
    return n * STATE_BYTES.get(v.nbytes // max(1, n), 8)


def choose(
    graph: Graph,
    release_order: Sequence[str],
    device: str,
    budgets: Mapping[str, str | int],
    share: float,
) -> Split:
    """The parameters released last (the end of `release_order`, names) whose weights, gradients and optimizer
    state fit in `share` of `device`'s budget, and the budgets to plan within."""
    if not 0 < share < 1:
        raise XschedError(f"the optimizer's share of {device}'s budget must be in (0, 1), got {share}", stage="train")
    budget = parse_budget(budgets[device], device=device)  # bytes: a "%" budget is refused here
    vid = {graph.value[v].name: v for v in graph.inputs if graph.value[v].kind == "param"}
    allowance = int(budget * share)
    chosen, used, state = [], 0, 0
    for name in reversed(release_order):
        v = vid.get(name)
        if v is None:
            continue
        extra = state_bytes(graph, v)
        cost = 2 * graph.value[v].nbytes + extra  # weight and gradient (in the graph) and the state (not)
        if used + cost > allowance:
            break
        chosen.append(v)
        used, state = used + cost, state + extra
    return Split(device, tuple(chosen), used, state, {**budgets, device: budget - state})


def choose_timed(
    graph: Graph,
    groups: Sequence[Group],
    model: StepModel,
    device: str,
    budgets: Mapping[str, str | int],
    share: float,
) -> Split:
    """The groups of parameters whose update on `device`, within `share` of its budget, gives the least predicted
    step (xsched.train.split_time), and the budgets to plan within."""
    if not 0 < share < 1:
        raise XschedError(f"the optimizer's share of {device}'s budget must be in (0, 1), got {share}", stage="train")
    budget = parse_budget(budgets[device], device=device)
    moved = choose_groups(groups, model, int(budget * share))
    chosen = tuple(v for i in sorted(moved) for v in groups[i].params)
    state = sum(state_bytes(graph, v) for v in chosen)
    used = sum(groups[i].bytes for i in moved)
    return Split(device, chosen, used, state, {**budgets, device: budget - state})


def split_plan(
    graph: Graph,
    release_order: Sequence[str],
    device: str,
    budgets: Mapping[str, str | int],
    share: float,
    solve: Callable[[Mapping[str, str | int], Mapping[str, str]], object],
    homes: Mapping[str, str],
    pick: Callable[[float], Split] | None = None,
) -> tuple[Split, object]:
    """Solve with the split of `share` (`pick(share)`; default: the parameters released last that fit), halving
    the share while no plan is found (down to nothing moved: the plan with every parameter on its home in `homes`).
    `solve(budgets, homes)` plans; returns the split and its plan."""
    while True:
        split = pick(share) if pick is not None else choose(graph, release_order, device, budgets, share)
        moved = {**homes, **dict.fromkeys(split.params, device)}
        try:
            return split, solve(split.budgets, moved)
        except BudgetError:
            if not split.params:
                raise
            share /= 2
            if share < 1e-3:
                empty = Split(device, (), 0, 0, dict(budgets))
                return empty, solve(budgets, homes)


def numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n
