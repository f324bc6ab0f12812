"""The report's charts as inline SVG: time against each device's budget, machines against each other, and time
against energy."""

from __future__ import annotations

from collections.abc import Sequence

from xsched.report.draw import COLORS, byte_unit, figure, fmt_bytes, time_unit, to_svg
from xsched.report.energy import EnergyStudy
from xsched.report.sweep import Point, Sweep
from xsched.report.whatif import MachineResult

STYLES = ("o-", "s--", "^:", "D-.", "v-", "P--")  # per machine: lines that coincide stay told apart


def ring(k: int) -> dict:
    """Hollow markers shrinking with k: where machines' points coincide, they show as concentric rings."""
    return {"ms": max(10 - 2 * k, 4), "mfc": "none", "mew": 1.5}


MARKERS = {"eager": "s", "greedy": "^", "checkpoint": "D", "offload": "v", "sqrt": "P", "fastest": "*"}


def _no_plan_marks(ax, xs: list[float], color: str) -> None:
    """Budgets where the method found no plan: crosses on the x axis."""
    if xs:
        ax.plot(
            xs,
            [0.0] * len(xs),
            "x",
            color=color,
            ms=7,
            mew=2,
            clip_on=False,
            transform=ax.get_xaxis_transform(),
            zorder=5,
        )


def _method_lines(ax, points: Sequence[Point], methods: Sequence[str], scale: float, div: float) -> None:
    for k, m in enumerate(methods):
        pts = sorted((p for p in points if p.method == m), key=lambda p: p.budget_bytes)
        ok = [p for p in pts if p.ok]
        main = k == 0
        ax.plot(
            [p.budget_bytes / div for p in ok],
            [p.step_s * scale for p in ok],
            marker="o" if main else MARKERS.get(m, "o"),
            color=COLORS[k % len(COLORS)],
            lw=2.2 if main else 1.2,
            ms=5 if main else 4,
            ls="-" if main else "--",
            label=m,
            zorder=4 if main else 3,
        )
        if main:
            _no_plan_marks(ax, [p.budget_bytes / div for p in pts if not p.ok], COLORS[0])


def sweep_figure(sweeps: Sequence[Sweep], methods: Sequence[str]) -> str:
    """One panel per swept device: predicted time against that device's budget, the method and its baselines,
    with the proven lower bound and the eager peak as vertical lines."""
    n = len(sweeps)
    cols = min(n, 3)
    fig = figure(4.6 * cols, 3.6 * ((n + 2) // 3))
    axes = fig.subplots((n + 2) // 3, cols, squeeze=False).ravel()
    scale, unit = time_unit([p.step_s for s in sweeps for p in s.points if p.ok])
    for ax, s in zip(axes, sweeps):
        div, bunit = byte_unit([p.budget_bytes for p in s.points])
        _method_lines(ax, s.points, methods, scale, div)
        for x, name, style, y in ((s.lower_bound, "lower bound", ":", 0.99), (s.eager_peak, "eager peak", "-.", 0.9)):
            ax.axvline(x / div, color="0.4", ls=style, lw=1)
            ax.text(x / div, y, f" {name}", transform=ax.get_xaxis_transform(), va="top", fontsize=7, color="0.3")
        ax.set_xlabel(f"budget of {s.label} ({bunit})")
        ax.set_ylabel(f"predicted makespan per iteration ({unit})")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.set_title(s.machine, fontsize=9)
    for ax in axes[n:]:
        ax.set_visible(False)
    axes[0].legend(fontsize=8, loc="lower right")
    return to_svg(fig, "sweep")


def whatif_figure(results: Sequence[MachineResult], method: str) -> str:
    """Left: time against the budget of each machine's accelerators (each set to it), one line per machine.
    Right: the fastest plan of each machine at its base budgets, its time and energy."""
    fig = figure(12.5, 3.6 + 0.3 * len(results))
    left, mid, right = fig.subplots(1, 3, width_ratios=(1.6, 1, 1))
    times = [p.step_s for r in results for p in (*r.sweep.points, *r.points) if p.ok]
    scale, unit = time_unit(times)
    div, bunit = byte_unit([p.budget_bytes for r in results for p in r.sweep.points])
    for k, r in enumerate(results):
        pts = sorted((p for p in r.sweep.points if p.method == method), key=lambda p: p.budget_bytes)
        ok = [p for p in pts if p.ok]
        color = COLORS[k % len(COLORS)]
        left.plot(
            [p.budget_bytes / div for p in ok],
            [p.step_s * scale for p in ok],
            STYLES[k % len(STYLES)],
            color=color,
            label=r.machine.label,
            **ring(k),
        )
        _no_plan_marks(left, [p.budget_bytes / div for p in pts if not p.ok], color)
    left.set_xlabel(f"budget of each accelerator ({bunit})")
    left.set_ylabel(f"predicted makespan per iteration ({unit})")
    left.set_ylim(bottom=0)
    left.grid(alpha=0.3)
    left.legend(fontsize=7)
    left.set_title(f"{method}: time against accelerator budget", fontsize=9)
    best = [r.best for r in results]
    ys = list(range(len(results)))[::-1]
    colors = [COLORS[k % len(COLORS)] for k in range(len(results))]
    bars = (
        (mid, [b.step_s * scale if b else None for b in best], f"makespan per iteration ({unit})", "fastest plan"),
        (right, [b.energy_j if b else None for b in best], "energy per iteration (J)", "its energy"),
    )
    for ax, vals, xlabel, title in bars:
        ax.barh(ys, [v or 0.0 for v in vals], color=colors)
        top = max((v for v in vals if v), default=1.0)
        for y, v in zip(ys, vals):
            ax.text(v or 0.0, y, " no plan" if v is None else f" {v:.3g}", va="center", fontsize=8)
        ax.set_xlim(0, top * 1.3)
        ax.set_xlabel(xlabel)
        ax.set_title(f"at base budgets: {title}", fontsize=9)
        ax.grid(alpha=0.3, axis="x")
        ax.set_yticks(ys, [r.machine.label for r in results] if ax is mid else [""] * len(ys), fontsize=7)
    return to_svg(fig, "whatif")


def energy_figure(studies: Sequence[EnergyStudy]) -> str:
    """Left: time against energy of each machine's plans minimising time + alpha x energy. Right: each machine's
    fastest plan against the energy cap."""
    fig = figure(11.5, 4.0)
    left, right = fig.subplots(1, 2)
    scale, unit = time_unit([p.step_s for x in studies for p in x.points if p.ok])
    for k, x in enumerate(studies):
        color, style = COLORS[k % len(COLORS)], STYLES[k % len(STYLES)]
        alphas = [p for p in x.points if p.kind == "alpha" and p.ok]
        left.plot(
            [p.energy_j for p in alphas],
            [p.step_s * scale for p in alphas],
            style,
            color=color,
            label=x.machine,
            **ring(k),
        )
        groups: dict[tuple[float, float], list[float]] = {}  # one label per distinct plan: the alphas that chose it
        for p in alphas:
            groups.setdefault((p.energy_j, p.step_s), []).append(p.alpha / (x.alpha_unit or 1))
        for (e, t), fs in groups.items():
            tag = "α=" + (f"{fs[0]:.3g}" if len(fs) == 1 else f"{min(fs):.3g}…{max(fs):.3g}") + "u"
            left.annotate(
                tag,
                (e, t * scale),
                textcoords="offset points",
                xytext=(6, -12 if k % 2 else 4),
                fontsize=7,
                color=color,
            )
        caps = sorted((p for p in x.points if p.kind == "cap"), key=lambda p: p.cap_j or 0.0)
        ok = [p for p in caps if p.ok]
        right.plot(
            [p.cap_j for p in ok], [p.step_s * scale for p in ok], style, color=color, label=x.machine, **ring(k)
        )
        _no_plan_marks(right, [p.cap_j for p in caps if not p.ok], color)
    left.set_xlabel("energy per iteration (J)")
    left.set_title("minimise time + α·energy", fontsize=9)
    right.set_xlabel("energy cap (J per iteration)")
    right.set_title("fastest plan under an energy cap (× = none found)", fontsize=9)
    for ax in (left, right):
        ax.set_ylabel(f"predicted makespan per iteration ({unit})")
        ax.grid(alpha=0.3)
        ax.set_ylim(bottom=0)
        ax.set_xlim(left=0)
    left.legend(fontsize=7)
    fig.suptitle("; ".join(sorted({x.source for x in studies})), fontsize=9)
    return to_svg(fig, "energy")


def budget_note(points: Sequence[Point]) -> str:
    """'budgets 12 KiB to 1.2 MiB' for captions."""
    bs = [p.budget_bytes for p in points]
    return f"budgets {fmt_bytes(min(bs))} to {fmt_bytes(max(bs))}" if bs else "no budgets"


def family(name: str) -> str:
    """A measured row's kind, by its label: xsched's plans, torch.compile's, or torch's own savers."""
    return "xsched" if name.startswith("xsched") else "torch.compile" if name.startswith("torch.compile") else "torch"


def frontier_figure(rows: Sequence[dict], title: str) -> str:
    """Measured step time against measured step peak, one marker per row that ran (scripts/bench_gpu_memory.py's
    JSON rows: `plan`, `time_s`, `peak`), torch's savers, torch.compile's and xsched's apart; lower left is better."""
    ok = [r for r in rows if "error" not in r and r.get("time_s") and r.get("peak") is not None]
    fig = figure(7.5, 4.8)
    ax = fig.subplots()
    div, bunit = byte_unit([r["peak"] for r in ok])
    scale, unit = time_unit([r["time_s"] for r in ok])
    for k, (name, marker) in enumerate((("torch", "o"), ("torch.compile", "s"), ("xsched", "^"))):
        mine = [r for r in ok if family(r["plan"]) == name]
        if not mine:
            continue
        xs, ys = [r["peak"] / div for r in mine], [r["time_s"] * scale for r in mine]
        ax.scatter(xs, ys, marker=marker, color=COLORS[k], label=name)
        for r, x, y in zip(mine, xs, ys):
            ax.annotate(r["plan"], (x, y), fontsize=6, xytext=(3, 3), textcoords="offset points")
    ax.set_xlabel(f"measured step peak ({bunit}, above what is resident)")
    ax.set_ylabel(f"measured step time ({unit})")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return to_svg(fig, "frontier")
