"""Pictures of one plan: the compute and keep matrices per device (stage x op, stage x value, as in the Checkmate
and XEngine papers' figures), memory over time per device against its budget, and the compute and copy lanes of
the overlapped model over time."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from xsched.contracts.graph import Graph, Op
from xsched.contracts.plan import Compute, Copy, Plan
from xsched.contracts.profile import Profile
from xsched.lanes import lane_of
from xsched.report.draw import COLORS, byte_unit, figure, fmt_bytes, time_unit, to_svg
from xsched.simulate import SimResult, Simulator
from xsched.solve.bounds.time import TimeBound

PHASE_COLORS = {"fwd": COLORS[0], "loss": COLORS[4], "bwd": COLORS[2]}
RECOMPUTE, COPY = COLORS[1], COLORS[3]


@dataclass(frozen=True)
class Walk:
    """What the pictures need from one simulated walk: per step its stage (Checkmate's: stage t ends with the
    first compute of the t-th op to be computed) and sequential duration; per stage and device the values
    resident when the stage's first compute starts; the simulator's result."""

    stage: tuple[int, ...]
    durations: tuple[float, ...]
    kept: tuple[Mapping[str, frozenset[str]], ...]
    order: tuple[str, ...]  # op ids in first-compute order: stage t first computes order[t]
    result: SimResult


class _Watch(Simulator):
    def __init__(self, graph: Graph, plan: Plan, profile: Profile) -> None:
        super().__init__(graph, plan, profile, check_budgets=False)
        self.order: list[str] = []
        self.stages: list[int] = []
        self.kept: list[dict[str, frozenset[str]]] = []

    def on_compute(self, i: int, s: Compute, op: Op) -> None:
        super().on_compute(i, s, op)
        if len(self.kept) == len(self.order):  # the stage's first compute: what is resident as it starts
            self.kept.append({d: frozenset(vs) for d, vs in self.resident.items()})

    def after_step(self, i: int, s) -> None:
        super().after_step(i, s)
        self.stages.append(len(self.order))
        if isinstance(s, Compute) and s.op not in self.order:
            self.order.append(s.op)


def walk(graph: Graph, plan: Plan, profile: Profile) -> Walk:
    w = _Watch(graph, plan, profile)
    result = w.run()
    return Walk(tuple(w.stages), tuple(w.durations), tuple(w.kept), tuple(w.order), result)


def matrices(graph: Graph, plan: Plan, w: Walk) -> dict[str, tuple[Any, Any]]:
    """Per device (compute, keep): compute[t, k] = 1 where op k (graph order) is first computed in stage t on the
    device, 2 where it is recomputed; keep[t, j] = 1 where produced value j (by producer) is resident on the
    device as stage t starts."""
    import numpy as np

    n = len(w.kept)  # stages with a compute (a recompute after the last first compute opens one more)
    op_row = {o.id: k for k, o in enumerate(graph.ops)}
    produced = [v for o in graph.ops for v in o.outputs]
    value_row = {v: j for j, v in enumerate(produced)}
    seen: set[str] = set()
    out = {}
    for d in plan.devices:
        out[d] = (np.zeros((n, len(graph.ops)), dtype=np.int8), np.zeros((n, len(produced)), dtype=np.int8))
    for i, s in enumerate(plan.steps):
        if isinstance(s, Compute):
            out[s.device][0][w.stage[i], op_row[s.op]] = 2 if s.op in seen else 1
            seen.add(s.op)
    for t, kept in enumerate(w.kept):
        for d, vs in kept.items():
            rows = [value_row[v] for v in vs if v in value_row]
            out[d][1][t, rows] = 1
    return out


def matrices_figure(graph: Graph, plan: Plan, w: Walk) -> str:
    """Rows: the devices the plan computes or keeps anything on; left the compute matrix, right the keep matrix;
    x = stage, y = op / value."""
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    mats = {d: m for d, m in matrices(graph, plan, w).items() if m[0].any() or m[1].any()}  # devices it touches
    fig = figure(11, 3.3 * len(mats) + 0.4)
    axes = fig.subplots(len(mats), 2, squeeze=False)
    compute_map = ListedColormap(["white", COLORS[0], RECOMPUTE])
    keep_map = ListedColormap(["white", "0.35"])
    for (ax_c, ax_k), (d, (comp, keep)) in zip(axes, mats.items()):
        ax_c.imshow(comp.T, cmap=compute_map, vmin=0, vmax=2, aspect="auto", interpolation="nearest")
        stage, row = (comp == 2).nonzero()
        ax_c.scatter(stage, row, s=14, marker="s", color=RECOMPUTE, zorder=3)  # a recompute is one cell: mark it
        ax_k.imshow(keep.T, cmap=keep_map, vmin=0, vmax=1, aspect="auto", interpolation="nearest")
        recomputes = int((comp == 2).sum())
        ax_c.set_title(f"{d}: compute ({int((comp > 0).sum())} computes, {recomputes} recomputes)", fontsize=9)
        ax_k.set_title(f"{d}: keep (values resident as each stage starts)", fontsize=9)
        ax_c.set_ylabel("op (graph order)")
        ax_k.set_ylabel("value (by producer)")
        for ax in (ax_c, ax_k):
            ax.set_xlabel("stage")
    handles = [
        Patch(color=COLORS[0], label="first compute"),
        Patch(color=RECOMPUTE, label="recompute"),
        Patch(color="0.35", label="resident"),
    ]
    fig.legend(handles=handles, loc="outside lower center", ncols=3, fontsize=8)
    return to_svg(fig, "matrices")


def memory_figure(graph: Graph, plan: Plan, w: Walk) -> str:
    """Per device: bytes resident after each step over the sequential time, its peak (outputs and workspace of a
    running compute included) and its budget."""
    import numpy as np

    r = w.result
    devices = plan.devices
    fig = figure(11, 2.2 * len(devices) + 0.6)
    axes = fig.subplots(len(devices), 1, squeeze=False, sharex=True).ravel()
    ends = np.cumsum(w.durations)
    scale, unit = time_unit([float(ends[-1])] if len(ends) else [])
    homed = {d: sum(graph.value[v].nbytes for v, h in plan.homes.items() if h == d) for d in devices}
    for ax, d in zip(axes, devices):
        peak, at, budget = r.peak_bytes[d], r.peak_step[d], plan.budgets.get(d)
        # the budget is drawn when it is near the curve; a budget far above it would flatten the curve
        near = budget is not None and (budget <= 3 * peak or peak == 0)
        div, bunit = byte_unit([peak, budget if near else 0])
        xs = [0.0, *(ends * scale)]
        ys = [homed[d] / div, *(after[d] / div for after in r.resident_after)]
        ax.step(xs, ys, where="post", color=COLORS[0], lw=1.2, label="resident after each step")
        x_peak = (ends[at] - w.durations[at]) * scale if at >= 0 else 0.0
        ax.plot([x_peak], [peak / div], "v", color=COLORS[3], label=f"peak {fmt_bytes(peak)}")
        if near:
            ax.axhline(budget / div, color="0.2", ls="--", lw=1, label=f"budget {fmt_bytes(budget)}")
        elif budget is not None:
            ax.text(
                0.99,
                0.95,
                f"budget {fmt_bytes(budget)} (off scale)",
                transform=ax.transAxes,
                ha="right",
                va="top",
                fontsize=8,
            )
        if peak == 0:
            ax.text(0.5, 0.5, "not used by this plan", transform=ax.transAxes, ha="center", fontsize=9, color="0.3")
        top = max(peak, budget if near else 0) / div
        ax.set_ylim(0, top * 1.1 if top > 0 else 1.0)
        ax.set_ylabel(f"{d} ({bunit})", fontsize=8)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper left")
    axes[-1].set_xlabel(f"sequential time ({unit}): the steps one after another, as the solver counts them")
    return to_svg(fig, "memory")


def timeline_figure(graph: Graph, plan: Plan, w: Walk, bound: TimeBound | None = None) -> str:
    """The overlapped model's lanes over time: computes coloured by phase (recomputes apart), copies, makespan, and
    the lower bound on any plan's makespan (`bound`) as a dotted line."""
    r = w.result
    lanes = [lane_of(s) for s in plan.steps]
    order = sorted(
        {k for k, s in zip(lanes, plan.steps) if not k.startswith("free")}, key=lambda k: (k.split(":", 1)[1], k)
    )
    fig = figure(11, 0.55 * len(order) + 1.4)
    ax = fig.subplots()
    scale, unit = time_unit([r.makespan_s or 0.0])
    bars: dict[tuple[str, str], list[tuple[float, float]]] = {}
    seen: set[str] = set()
    for s, k, (a, b) in zip(plan.steps, lanes, r.step_span):
        if k.startswith("free"):
            continue
        if isinstance(s, Copy):
            color = COPY
        else:
            color = RECOMPUTE if s.op in seen else PHASE_COLORS.get(graph.op[s.op].phase, COLORS[7])
            seen.add(s.op)
        bars.setdefault((k, color), []).append((a * scale, max(b - a, 0.0) * scale))
    y = {k: len(order) - 1 - n for n, k in enumerate(order)}
    for (k, color), spans in bars.items():
        ax.broken_barh(spans, (y[k] - 0.4, 0.8), facecolors=color, edgecolor="none")
    ax.set_yticks([y[k] for k in order], order, fontsize=8)
    ax.axvline((r.makespan_s or 0.0) * scale, color="0.2", ls="--", lw=1)
    floor = ""
    if bound is not None:
        ax.axvline(bound.seconds * scale, color="0.2", ls=":", lw=1)
        floor = f"; no plan below {bound.seconds * scale:.4g} {unit} ({bound.by}, dotted)"
    ax.set_xlabel(
        f"overlapped time ({unit}); makespan {(r.makespan_s or 0) * scale:.4g} {unit}, sequential "
        f"{(r.time_s or 0) * scale:.4g} {unit}{floor}"
    )
    from matplotlib.patches import Patch

    handles = [Patch(color=c, label=n) for n, c in (*PHASE_COLORS.items(), ("recompute", RECOMPUTE), ("copy", COPY))]
    ax.legend(handles=handles, fontsize=7, ncols=5, loc="upper center", bbox_to_anchor=(0.5, 1.18))
    ax.grid(alpha=0.3, axis="x")
    return to_svg(fig, "timeline")
