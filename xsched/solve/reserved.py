"""Plans whose reserved memory fits: a validated plan replayed on the caching-allocator model, and re-planned at a
smaller budget while a GPU's predicted reserved memory exceeds its budget (bounded tries, within the time limit)."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import replace

from xsched.allocator import ReservedPeak, replay_reserved
from xsched.budgets import format_bytes
from xsched.errors import BudgetError
from xsched.solve.problem import Outcome, Problem

RESERVED_TRIES = 3  # re-plans at most
FIRST_SHARE = 0.5  # of the time limit, for the first solve when its plan may have to be re-planned


def reserved_devices(problem: Problem) -> list[str]:
    """The budgeted devices whose memory a CUDA caching allocator reserves (the profile says "cuda"): what the
    re-plan loop checks. Simulated accelerators have no such allocator."""
    info = problem.profile.devices
    return [d for d in problem.devices if d in problem.budgets and d in info and info[d].kind == "cuda"]


def reserved_over(problem: Problem, outcome: Outcome, expandable: bool = False) -> dict[str, ReservedPeak]:
    """The checked devices whose predicted reserved memory exceeds their budget, with the prediction. The upper end
    of the allocator model's range is used (the host a step ahead, the blocks side streams used held to the step's
    end): the end an H100 store plan measured (1.04 of it, docs/BENCHMARKS.md), and the one a run cannot exceed by
    the host running further ahead. `expandable`: the allocator with expandable segments, as the run will have it."""
    assert outcome.plan is not None
    devices = [d for d in reserved_devices(problem) if d in outcome.plan.devices]
    if not devices:
        return {}
    peaks = replay_reserved(
        problem.graph, outcome.plan, problem.profile, devices=devices, host_ahead=True, expandable=expandable
    )
    return {d: r for d, r in peaks.items() if r.reserved > problem.budgets[d]}


def fit_reserved(
    problem: Problem,
    solve_at: Callable[[Problem, float | None], Outcome],
    time_limit_s: float | None,
    tries: int = RESERVED_TRIES,
    expandable: bool = False,
) -> Outcome:
    """`solve_at(problem, seconds)`'s plan, re-planned at lower budgets until every checked device's predicted
    reserved memory fits its budget. A try scales the last plan's budget by the caller's budget over that plan's
    reserved memory; after a try that finds no plan, the next comes down half as far. The first solve gets
    FIRST_SHARE of the limit when a device is checked, each re-plan half of what is left (the last all of it). Raises BudgetError ("not found") when no tried plan fits,
    and solve_at's own error when the first solve finds none. `expandable`: the reserved memory is replayed with
    expandable segments (the run's allocator setting)."""
    if not reserved_devices(problem):
        return solve_at(problem, time_limit_s)
    start = time.perf_counter()
    outcome = solve_at(problem, None if time_limit_s is None else time_limit_s * FIRST_SHARE)
    fits: dict[str, int] = dict(problem.budgets)  # the budgets the last plan found was solved at
    cut: dict[str, int] = {}  # how far below `fits` the next try goes
    tried: list[str] = []
    over = reserved_over(problem, outcome, expandable)
    for k in range(tries):
        left = None if time_limit_s is None else time_limit_s - (time.perf_counter() - start)
        if not over or (left is not None and left <= 0):
            break
        # reserved taken to grow in proportion to the budget: the budget scaled by how far reserved overshoots
        cut = cut or {d: fits[d] - fits[d] * problem.budgets[d] // r.reserved for d, r in over.items()}
        lowered = replace(problem, budgets={**fits, **{d: fits[d] - c for d, c in cut.items()}})
        at = ", ".join(f"{d} at {format_bytes(lowered.budgets[d])}" for d in cut)
        try:
            outcome = solve_at(lowered, None if left is None else left / (2 if k < tries - 1 else 1))
        except BudgetError:  # nothing at that budget: come down half as far from the last plan found
            tried.append(f"{at}: no plan")
            cut = {d: c // 2 for d, c in cut.items() if c > 1}
            if not cut:
                break
            continue
        fits, cut = dict(lowered.budgets), {}
        over = reserved_over(problem, outcome, expandable)
        tried.append(f"{at}: " + ("fits" if not over else _reserves(over)))
    if not over:
        return outcome if not tried else _noted(outcome, tried)
    raise BudgetError(
        f"no plan found whose predicted reserved memory fits its budget (caching allocator model"
        f"{', expandable segments' if expandable else ''}, host a step ahead): the plan found {_reserves(over)} against {', '.join(format_bytes(problem.budgets[d]) for d in over)}"
        f"; not found within {len(tried)} re-plans ({'; '.join(tried) or 'no time left'})",
        stage="solve",
        device=next(iter(over)),
    )


def _reserves(over: Mapping[str, ReservedPeak]) -> str:
    return ", ".join(f"{d} reserves {format_bytes(r.reserved)}" for d, r in over.items())


def _noted(outcome: Outcome, tried: list[str]) -> Outcome:
    """The outcome with the re-plans in its record's message (what --explain prints)."""
    assert outcome.plan is not None
    note = "re-planned for reserved memory: " + "; ".join(tried)
    record = replace(outcome.record, message="; ".join(m for m in (outcome.record.message, note) if m))
    return Outcome(record, replace(outcome.plan, solver=record))
