"""A compiled plan's memory after its first run: its predicted peak from the compiled regions' real allocations, and
what happens where that goes over a budget (the plan solved again within the budget less the excess, or the regions
that overrun run uncompiled, as the plan counted them).

The solvers count each value a plan keeps (per op). A compiled region allocates otherwise: its fused intermediates
never materialise, and inductor's buffers are its own. Its first run measures it (`segments`); the plan's peak is
then the walk of the plan with each region counted as measured (`segments.compiled_peaks`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from xsched.budgets import format_bytes
from xsched.contracts.graph import Graph
from xsched.contracts.plan import Plan, Prediction
from xsched.execute.segments import compiled_peaks, region_peaks
from xsched.pipeline import PER_OP_KEY

PLANNED_WITHIN_KEY = "planned_within"  # Plan.extra: the lowered budgets a re-plan was solved within


def over_budget(peaks: Mapping[str, int], limits: Mapping[str, int]) -> dict[str, int]:
    """Device -> the bytes its peak goes over its limit (devices within their limits, or without one, left out)."""
    return {d: p - limits[d] for d, p in peaks.items() if d in limits and p > limits[d]}


def lowered_budgets(plan: Plan, over: Mapping[str, int]) -> dict[str, int]:
    """The budgets the plan was solved within (a re-plan's lowered ones) with each device over its limit lowered by
    its excess: the next re-plan's per-op budgets, aiming its compiled peak at the limit."""
    within = plan.extra.get(PLANNED_WITHIN_KEY, plan.budgets)
    return {d: b - over.get(d, 0) for d, b in within.items()}


def as_replanned(plan: Plan, limits: Mapping[str, int]) -> Plan:
    """A plan solved within lowered budgets, recorded against the limits it must meet (the lowered ones in extra)."""
    extra = {**plan.extra, PLANNED_WITHIN_KEY: dict(plan.budgets)}
    return dataclasses.replace(plan, budgets={**plan.budgets, **limits}, extra=extra)


def with_compiled_peaks(plan: Plan, peaks: Mapping[str, int]) -> Plan:
    """`plan` predicting `peaks` (its compiled regions counted as measured), its per-op count kept in extra."""
    p = plan.predicted or Prediction(None, {})
    extra = {**plan.extra, PER_OP_KEY: dict(plan.extra.get(PER_OP_KEY, p.peak_bytes))}
    return dataclasses.replace(plan, predicted=dataclasses.replace(p, peak_bytes=dict(peaks)), extra=extra)


def uncompile_overruns(graph: Graph, plan: Plan, segments: Any, limits: Mapping[str, int]) -> dict[str, int]:
    """Every measured region of `segments` (an executor's Segments) whose peak goes over its device's limit runs
    uncompiled from now on, each with a one-line notice; the plan's peaks with the regions left."""
    for steps, (device, peak) in region_peaks(graph, plan, segments.peaks).items():
        if device in limits and peak > limits[device]:
            why = f"compiled, it peaks at {format_bytes(peak)}, over the budget {format_bytes(limits[device])}"
            segments.uncompile(steps, device, why)
    return compiled_peaks(graph, plan, segments.peaks)
