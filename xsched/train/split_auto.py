"""The optimizer split's share chosen by the planner (`--optimizer-split auto`): the device bytes the all-home plan
leaves under the compute budget (less the allocator model's fragmentation) are the allowance; the groups of
parameters whose update there gives the least predicted step (xsched.train.split_time) move with their AdamW; the
plan is solved again with them homed there, the allowance halved while that plan does not fit or predicts no better
step; the split with the best predicted step of its own plan (its run and the host AdamW modelled) is kept."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from xsched.budgets import format_bytes, parse_budget
from xsched.contracts.graph import Graph
from xsched.contracts.plan import Plan
from xsched.contracts.profile import Profile
from xsched.errors import BudgetError, XschedError
from xsched.train.placement import Split, choose_timed, numel
from xsched.train.split_inputs import plan_groups
from xsched.train.split_time import Group, StepModel, predict_step

MAX_SOLVES = 4  # re-solves (grown or halved allowances): each is a full plan, seconds on a 3B model


class Planned(Protocol):
    """A solved plan and the costs it was made on (xsched.train.plans.CachedPlan is one)."""

    plan: Plan
    profile: Profile


@dataclass(frozen=True)
class AutoSplit:
    """The split chosen (nothing moved: no parameters) and its plan; the predicted step (s) with it, how late the
    host's AdamW is in it (s), and the step with nothing moved; the room the all-home plan left (bytes, after
    `margin`); and why the search stopped."""

    split: Split
    planned: Planned
    step_s: float
    late_s: float
    before_s: float
    room: int
    margin: int
    stopped: str

    @property
    def share(self) -> float:
        """The bytes moved (weights, gradients and AdamW state) as a share of the compute budget."""
        budget = parse_budget(self.split.budgets[self.split.device], device=self.split.device) + self.split.state_bytes
        return self.split.bytes / budget


def plan_step(graph: Graph, planned: Planned, home: str, host_rate: float, device_rate: float) -> tuple[float, float]:
    """The predicted step (s) of a plan whose parameters homed on `home` are updated there by the host's AdamW and
    the rest on the computing device (split_time's model on the plan's own run), and the host's lateness (s)."""
    groups, run_s = plan_groups(graph, planned.plan, planned.profile, home=home)
    step, _ = predict_step(groups, (), StepModel(run_s, host_rate, device_rate))
    moved = sum(
        numel(graph.value[v].shape or ())
        for v, d in planned.plan.homes.items()
        if d != home and graph.value[v].kind == "param"
    )
    late = step - run_s
    return step + moved / device_rate, late


def fragmentation(graph: Graph, planned: Planned, device: str) -> int:
    """On a CUDA device, the caching allocator model's reserved bytes beyond the plan's peak (rounding, unsplit
    blocks; the host a step ahead, the end the solver keeps within the budget: xsched.solve.reserved): memory under
    the budget that the split's state, allocated beside the plan, cannot have. 0 elsewhere (no such allocator)."""
    info = planned.profile.devices.get(device)
    if info is None or info.kind != "cuda":
        return 0
    from xsched.allocator import replay_reserved

    peak = replay_reserved(graph, planned.plan, planned.profile, devices=[device], host_ahead=True)[device]
    return max(0, peak.reserved - peak.plan_peak)


def choose_auto(
    graph: Graph,
    planned: Planned,
    device: str,
    home: str,
    budgets: Mapping[str, str | int],
    homes: Mapping[str, str],
    rates: tuple[float, float],
    solve: Callable[[Mapping[str, str | int], Mapping[str, str]], Planned],
) -> AutoSplit:
    """The split of the least predicted step within the room `planned` (every parameter on `home`) leaves on
    `device`, grown into the room its own plan leaves while the step improves; `rates`: AdamW's parameters/s on
    `home` and on `device`; `solve(budgets, homes)` plans (raising BudgetError where no plan fits)."""
    groups, run_s = plan_groups(graph, planned.plan, planned.profile, home=home)
    if not groups:
        raise XschedError(
            f"--optimizer-split auto: no parameter with a gradient is homed on {home}, so none can move to {device}",
            stage="train",
            device=home,
        )
    model = StepModel(run_s, *rates)
    before = predict_step(groups, (), model)[0]
    budget = parse_budget(budgets[device], device=device)
    margin = fragmentation(graph, planned, device)
    room = max(0, budget - planned.plan.predicted.peak_bytes.get(device, 0) - margin)
    best = AutoSplit(Split(device, (), 0, 0, dict(budgets)), planned, before, before - run_s, before, room, margin, "")
    notes: list[str] = []
    allowance = room
    for _ in range(MAX_SOLVES):
        allowance = min(allowance, budget - 1)
        split = choose_timed(graph, groups, model, device, budgets, allowance / budget) if allowance > 0 else None
        if split is None or not split.params:
            notes.append(_no_gain(groups, allowance))
            break
        if split.params == best.split.params:
            notes.append(
                f"moving more adds more device time than it hides (the host AdamW {best.late_s * 1e3:.3g} ms late)"
            )
            break
        try:
            again = solve(split.budgets, {**homes, **dict.fromkeys(split.params, device)})
        except BudgetError as e:
            notes.append(f"{format_bytes(split.bytes)} moved: no plan ({e.detail[:80]}), halved")
            allowance = split.bytes // 2
            if allowance <= best.split.bytes:
                break
            continue
        step, late = plan_step(graph, again, home, *rates)
        if not step < best.step_s:
            notes.append(f"{format_bytes(split.bytes)} moved: predicted {step * 1e3:.4g} ms, no better")
            if best.split.params:  # growing stopped paying
                break
            allowance = split.bytes // 2
            continue
        best = AutoSplit(split, again, step, late, before, room, margin, "")
        grown, note = _grown(graph, groups, best)
        notes.append(note)
        if grown is None:
            break
        allowance = grown
    else:
        notes.append(f"{MAX_SOLVES} plans made")
    return dataclasses.replace(best, stopped="; ".join(notes))


def _grown(graph: Graph, groups: Sequence[Group], best: AutoSplit) -> tuple[int | None, str]:
    """The allowance to try next after `best` (its bytes and the room its own plan leaves), or None where the host
    update is hidden or no unmoved group fits that room; and what happened, in words."""
    split, device = best.split, best.split.device
    if best.late_s <= 1e-12:
        return None, "the host update is hidden"
    left = parse_budget(split.budgets[device], device=device) - best.planned.plan.predicted.peak_bytes.get(device, 0)
    left -= fragmentation(graph, best.planned, device)
    unmoved = [g.bytes for g in groups if not set(g.params) <= set(split.params)]
    if not unmoved or left < min(unmoved):
        return None, f"the room is full (the host AdamW still {best.late_s * 1e3:.3g} ms late)"
    return split.bytes + left, (
        f"{format_bytes(split.bytes)} moved: predicted {best.step_s * 1e3:.4g} ms, {format_bytes(left)} left"
    )


def _no_gain(groups: Sequence[Group], allowance: int) -> str:
    """Why nothing moves within `allowance`: no group fits it, or none's move helps."""
    smallest = min(g.bytes for g in groups)
    if allowance < smallest:
        return f"the room ({format_bytes(allowance)}) holds no group (the smallest takes {format_bytes(smallest)})"
    return "no group's move lowers the predicted step (its update on the device takes longer than it hides)"
