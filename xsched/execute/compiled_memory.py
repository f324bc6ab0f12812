"""A compiled plan's memory after its first run: its predicted peak from the compiled regions' real allocations, and
what happens where that goes over a budget (the regions that overrun split in two and measured again, the plan
solved again within the budget less the excess, or the regions that overrun run uncompiled, as the plan counted
them) or where a re-plan stays far under it (solved once more within more, the plan that fits kept to go back to).

The solvers count each value a plan keeps (per op). A compiled region allocates otherwise: its fused intermediates
never materialise, and inductor's buffers are its own. Its first run measures it (`segments`); the plan's peak is
then the walk of the plan with each region counted as measured (`compiled_walk.compiled_peaks`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from xsched.budgets import format_bytes
from xsched.contracts.graph import Graph
from xsched.contracts.plan import Plan, Prediction
from xsched.execute.compiled_walk import compiled_peaks, region_peaks
from xsched.pipeline import PER_OP_KEY

PLANNED_WITHIN_KEY = "planned_within"  # Plan.extra: the lowered budgets a re-plan was solved within
# A re-plan lowers its per-op budget by the first plan's whole excess, but its own regions allocate otherwise: on
# gpt2 small (CPU) it peaked 15% under the limit, memory that fewer recomputes could use. Room over RAISE_SLACK of
# the limit is worth one more solve, within RAISE_SHARE of the room more (a bisection step: the compiled peak is
# not linear in the per-op budget); the plan that fits is kept, to go back to if the raised one overruns.
RAISE_SLACK = 0.05
RAISE_SHARE = 0.5
# Rounds of splits before a plan still over its budget is solved again: each cuts the regions that overrun where
# their peak is (`compiled_cuts`), and a part of one compute runs uncompiled, allocating as the plan counts, so
# every round makes progress (cut in the middle, the 150 computes of gpt2 small's largest backward region took 7).
MAX_SPLITS = 10


def over_budget(peaks: Mapping[str, int], limits: Mapping[str, int]) -> dict[str, int]:
    """Device -> the bytes its peak goes over its limit (devices within their limits, or without one, left out)."""
    return {d: p - limits[d] for d, p in peaks.items() if d in limits and p > limits[d]}


def lowered_budgets(plan: Plan, over: Mapping[str, int]) -> dict[str, int]:
    """The budgets the plan was solved within (a re-plan's lowered ones) with each device over its limit lowered by
    its excess: the next re-plan's per-op budgets, aiming its compiled peak at the limit."""
    within = plan.extra.get(PLANNED_WITHIN_KEY, plan.budgets)
    return {d: b - over.get(d, 0) for d, b in within.items()}


def raised_budgets(plan: Plan, room: Mapping[str, int]) -> dict[str, int]:
    """The budgets a re-plan was solved within, each device with room under its limit raised by RAISE_SHARE of it:
    the next try's per-op budgets, aiming between the re-plan that fits and the limit."""
    within = plan.extra.get(PLANNED_WITHIN_KEY, plan.budgets)
    return {d: b + int(RAISE_SHARE * room.get(d, 0)) for d, b in within.items()}


def wasted_room(plan: Plan, peaks: Mapping[str, int], limits: Mapping[str, int]) -> dict[str, int]:
    """Device -> the bytes a re-plan's compiled peak leaves under its limit, where that is over RAISE_SLACK of the
    limit (a first plan, solved within the limits themselves, never: the solver already had all of them)."""
    if PLANNED_WITHIN_KEY not in plan.extra:
        return {}
    room = {d: limits[d] - p for d, p in peaks.items() if d in limits}
    return {d: r for d, r in room.items() if r > RAISE_SLACK * limits[d]}


def as_replanned(plan: Plan, limits: Mapping[str, int]) -> Plan:
    """A plan solved within lowered budgets, recorded against the limits it must meet (the lowered ones in extra)."""
    extra = {**plan.extra, PLANNED_WITHIN_KEY: dict(plan.budgets)}
    return dataclasses.replace(plan, budgets={**plan.budgets, **limits}, extra=extra)


def with_compiled_peaks(plan: Plan, peaks: Mapping[str, int]) -> Plan:
    """`plan` predicting `peaks` (its compiled regions counted as measured), its per-op count kept in extra."""
    p = plan.predicted or Prediction(None, {})
    extra = {**plan.extra, PER_OP_KEY: dict(plan.extra.get(PER_OP_KEY, p.peak_bytes))}
    return dataclasses.replace(plan, predicted=dataclasses.replace(p, peak_bytes=dict(peaks)), extra=extra)


def split_overruns(graph: Graph, plan: Plan, segments: Any, limits: Mapping[str, int]) -> bool:
    """Every measured region of `segments` (an executor's Segments) whose peak goes over its device's limit runs as
    two from the next call on (`Segments.split`), each measured on its first run; False when none did."""
    over = [
        (s, d, p) for s, (d, p) in region_peaks(graph, plan, segments.peaks).items() if d in limits and p > limits[d]
    ]
    for steps, device, peak in over:
        segments.split(
            steps, device, f"compiled, it peaks at {format_bytes(peak)}, over {format_bytes(limits[device])}"
        )
    segments.split_rounds += bool(over)
    return bool(over)


def uncompile_overruns(graph: Graph, plan: Plan, segments: Any, limits: Mapping[str, int]) -> dict[str, int]:
    """Every measured region of `segments` (an executor's Segments) whose peak goes over its device's limit runs
    uncompiled from now on, each with a one-line notice; the plan's peaks with the regions left."""
    for steps, (device, peak) in region_peaks(graph, plan, segments.peaks).items():
        if device in limits and peak > limits[device]:
            why = f"compiled, it peaks at {format_bytes(peak)}, over the budget {format_bytes(limits[device])}"
            segments.uncompile(steps, device, why)
    return compiled_peaks(graph, plan, segments.peaks)
