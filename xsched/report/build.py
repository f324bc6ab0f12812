"""Building a what-if report: the sweeps, device and energy what-ifs and plan pictures for one graph and one
profile, written as report.html with the numbers beside it (CSV, JSON, the plan, a predicted Chrome trace)."""

from __future__ import annotations

import datetime
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from xsched.budgets import format_bytes
from xsched.contracts.graph import Graph
from xsched.contracts.plan import Plan
from xsched.contracts.profile import Profile
from xsched.errors import XschedError
from xsched.report import data, energy, html
from xsched.report.draw import require
from xsched.report.machines import (
    Machine,
    accelerators,
    base_budgets,
    cost_source,
    energy_of,
    graph_summary,
    restrict,
    union_devices,
)
from xsched.report.sections import energy_section, frontier_section, sweep_section, whatif_section
from xsched.report.sweep import SweepSettings, count, plan_point
from xsched.report.whatif import Sweeps, device_whatif, machine_sweep
from xsched.solve.bounds.time import time_bound

SECTIONS = ("sweep", "whatif", "energy", "pictures")
KNEE = 1.1  # the pictured plan: the smallest swept budget whose plan is at most this much slower than the fastest


@dataclass(frozen=True)
class ReportSettings:
    """What to build: `sections` of SECTIONS, each solving as `sweep` says; the energy study at `alphas` (multiples
    of the fastest plan's time/energy) and `caps` energy caps; `progress` shows bars (on a TTY)."""

    sweep: SweepSettings = SweepSettings()
    sections: tuple[str, ...] = SECTIONS
    progress: bool = True
    alphas: tuple[float, ...] = energy.ALPHA_FACTORS
    caps: int = energy.CAPS
    measured: str | None = None  # scripts/bench_gpu_memory.py's --json: a section of its measured frontier


@dataclass(frozen=True)
class Report:
    """Where the report went: the page, every data file by name, and the summary a program reads (`--json`)."""

    html: Path
    files: dict[str, Path]
    summary: dict[str, Any] = field(default_factory=dict)


def check_settings(settings: ReportSettings) -> None:
    """Raise a one-line XschedError for a setting that cannot work, before any capturing, profiling or solving."""
    require()
    bad = [s for s in settings.sections if s not in SECTIONS]
    if bad or not settings.sections:
        raise XschedError(f"unknown section {bad[0] if bad else ''!r}; sections: {', '.join(SECTIONS)}", stage="report")
    from xsched.solve.registry import SOLVERS

    for m in settings.sweep.methods:
        if m != "auto" and m not in SOLVERS:
            raise XschedError(f"unknown method {m!r}; choose auto or one of {', '.join(SOLVERS)}", stage="report")
    if settings.sweep.points < 2 or settings.sweep.time_limit_s <= 0:
        raise XschedError("a sweep needs at least 2 points and a positive time limit", stage="report")


def _check(graph: Graph, profile: Profile, machines: Sequence[Machine], settings: ReportSettings) -> None:
    check_settings(settings)
    if not machines:
        raise XschedError("a report needs at least one machine", stage="report")
    profile.check_graph(graph.fingerprint)
    for d in union_devices(machines):
        restrict(profile, [d])  # names the device the profile lacks


def _check_budgets(profile: Profile, machines: Sequence[Machine], peak: int) -> None:
    for m in machines:  # every machine's budgets parse, whichever sections use them
        base_budgets(m, restrict(profile, m.devices), peak)


def build_report(
    graph: Graph,
    profile: Profile,
    machines: Sequence[Machine],
    out_dir: str | Path,
    settings: ReportSettings = ReportSettings(),
    command: str = "",
) -> Report:
    """Solve every what-if in `settings.sections` for `graph` on `machines` (costs from `profile`, which covers
    all their devices) and write report.html, its data files and summary into `out_dir`."""
    from tqdm.auto import tqdm

    from xsched.solve.reference import eager_peak

    _check(graph, profile, machines, settings)
    t0 = time.perf_counter()
    peak = eager_peak(graph)
    _check_budgets(profile, machines, peak)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    s, secs = settings.sweep, settings.sections
    first = machines[0]
    total = (
        (len(first.devices) * count(s) if "sweep" in secs else 0)
        + (len(machines) * (count(s) + len(s.methods)) if "whatif" in secs else 0)
        + (len(machines) * energy.count(settings.alphas, settings.caps) if "energy" in secs else 0)
    )
    bar = tqdm(total=total, desc=f"report {graph.name}", unit="plan", disable=None if settings.progress else True)
    files: dict[str, Path] = {}
    sections: list[html.Section] = []
    summary: dict[str, Any] = {"graph": graph_summary(graph), "eager_peak_bytes": peak, "machines": []}
    cache: Sweeps = {}
    with bar:
        tick = bar.update
        if "sweep" in secs:
            sweeps = [machine_sweep(graph, profile, first, (d,), peak, s, cache, tick) for d in first.devices]
            sections.append(sweep_section(sweeps, s, first, out, files))
            summary["sweep_points"] = sum(len(x.points) for x in sweeps)
        if "whatif" in secs:
            results = device_whatif(graph, profile, machines, peak, s, cache, tick)
            sections.append(whatif_section(results, s, out, files))
            summary["machines"] = [_machine_summary(r) for r in results]
        if "energy" in secs:
            studies = []
            for m in machines:
                sub = restrict(profile, m.devices)
                budgets = base_budgets(m, sub, peak)
                studies.append(energy.energy_study(graph, sub, m, budgets, s, tick, settings.alphas, settings.caps))
            sections.append(energy_section(studies, out, files))
            summary["energy_points"] = sum(len(x.points) for x in studies)
        if "pictures" in secs:
            plan, why = _picture_plan(graph, profile, first, peak, s, cache)
            sections.append(_pictures_section(graph, restrict(profile, first.devices), plan, why, out, files))
        if settings.measured:
            sections.append(frontier_section(Path(settings.measured), out, files))
    files["profile.json"] = out / "profile.json"
    profile.save(files["profile.json"])
    built = f"Built by xsched in {time.perf_counter() - t0:.0f} s on {datetime.date.today().isoformat()}"
    files["report.html"] = out / "report.html"
    files["report.html"].write_text(_page(graph, profile, machines, settings, peak, sections, built, command))
    files["report.json"] = out / "report.json"
    summary.update(
        {
            "html": str(files["report.html"]),
            "files": {k: str(v) for k, v in files.items()},
            "settings": data.plain(settings),
            "command": command,
            "build_s": round(time.perf_counter() - t0, 2),
        }
    )
    data.write_json(files["report.json"], summary)
    return Report(files["report.html"], files, summary)


def _page(
    graph: Graph,
    profile: Profile,
    machines: Sequence[Machine],
    settings: ReportSettings,
    peak: int,
    sections: list[html.Section],
    built: str,
    command: str,
) -> str:
    """The page around the sections: what was planned, from which costs, and how the report was made."""
    s = settings.sweep
    overview = html.Table(
        "Devices: where each one's costs come from",
        ("device", "memory", "op costs", "energy"),
        tuple(
            (d, format_bytes(profile.devices[d].memory_bytes), cost_source(profile, d), energy_of(profile, d))
            for d in union_devices(machines)
        ),
    )
    g = graph_summary(graph)
    phases = ", ".join(f"{n} {p}" for p, n in g["phases"].items())
    intro = [
        f"Graph {graph.name}: {g['ops']} ops ({phases}), {g['values']} values, eager peak {format_bytes(peak)}. "
        "Every number is a prediction of xsched's simulator from the profile below, for the plans the solver "
        f"({s.method}, {s.time_limit_s:g} s per plan) and the baselines found.",
        "Machines: " + "; ".join(m.label for m in machines) + ". The first device of a machine is the home of the "
        "parameters and inputs; a device without a budget may use all its memory.",
    ]
    footer = built + (f" with: {command}" if command else "")
    return html.page(f"What-if report: {graph.name}", intro, overview, sections, footer)


def _machine_summary(r: Any) -> dict[str, Any]:
    best = r.best
    return {
        "machine": r.machine.label,
        "devices": list(r.machine.devices),
        "budgets": dict(r.budgets),
        "costs": dict(r.sources),
        "energy": r.energy,
        "best": None
        if best is None
        else {
            "method": best.method,
            "found_by": best.found_by,
            "time_s": best.time_s,
            "makespan_s": best.makespan_s,
            "energy_j": best.energy_j,
            "peak_bytes": dict(best.peak_bytes),
        },
    }


def _step(plan: Plan) -> float:
    """A plan's makespan (its sequential time where it has none)."""
    p = plan.predicted
    return (p.makespan_s if p.makespan_s is not None else p.time_s) or 0.0


def _picture_plan(
    graph: Graph, profile: Profile, machine: Machine, peak: int, s: SweepSettings, cache: Sweeps
) -> tuple[Plan, str]:
    """The plan to picture: from the machine's accelerator sweep, the solver's plan at the knee of the curve (the
    smallest budget whose plan is within KNEE of the fastest: where recomputation and copies buy memory cheaply);
    without that sweep, at the base budgets."""
    sub = restrict(profile, machine.devices)
    acc = accelerators(sub, machine)
    sweep = cache.get((machine.label, acc))
    if sweep is not None and sweep.plans:
        fastest = min(_step(p) for p in sweep.plans.values())
        b = min(b for b, p in sweep.plans.items() if _step(p) <= KNEE * fastest)
        knee = f"the smallest budget swept within {KNEE - 1:.0%} of the fastest plan"
        return sweep.plans[b], f"{sweep.label} at {format_bytes(b)} ({knee})"
    base = base_budgets(machine, sub, peak)
    plan, status, note = plan_point(graph, sub, machine, base, s.method, s.options())
    if plan is None:
        raise XschedError(f"no plan to picture on {machine.label} at its base budgets: {note}", stage="report")
    return plan, "the base budgets"


def _pictures_section(graph: Graph, profile: Profile, plan: Plan, why: str, out: Path, files: dict) -> html.Section:
    from xsched.report import pictures
    from xsched.report.trace import predicted_trace, write_trace

    w = pictures.walk(graph, plan, profile)
    bound = time_bound(graph, profile, plan.devices, plan.homes, plan.budgets)
    files["plan.json"] = out / "plan.json"
    plan.save(files["plan.json"])
    files["predicted-trace.json"] = write_trace(predicted_trace(graph, plan, profile), out / "predicted-trace.json")
    method = f"{plan.solver.method} ({plan.solver.status})"
    figs = (
        html.Figure(
            "fig-matrices",
            pictures.matrices_figure(graph, plan, w),
            "Compute (left) and keep (right) matrices of each device the plan uses. Stage t ends with the "
            "first compute of the t-th op; a cell is an op computed in that stage (orange squares: again) "
            "or a value resident as it starts.",
        ),
        html.Figure(
            "fig-memory",
            pictures.memory_figure(graph, plan, w),
            "Bytes resident on each device after each step, over the sequential time; the triangle marks "
            "the peak, which counts a running op's outputs and workspace.",
        ),
        html.Figure(
            "fig-timeline",
            pictures.timeline_figure(graph, plan, w, bound),
            "The compute and copy lanes of the overlapped model (xsched.lanes): when each step runs. Dotted: the "
            f"lower bound on any plan's makespan ({bound.why}).",
        ),
    )
    intro = (
        f"The plan {method} for {why}: {len(plan.steps)} steps, {w.result.computes} computes, "
        f"{w.result.copies} copies. predicted-trace.json holds the same lanes as a Chrome trace (open it in "
        "ui.perfetto.dev); `xsched run MODEL plan.json --trace run.json` writes a measured one to compare."
    )
    from xsched.explain import reserved_text

    if text := reserved_text(graph, plan, profile):  # what runs out on a GPU is reserved memory, not the peak
        intro += " Fragmentation: " + text
    return html.Section("pictures", "Plan pictures", intro, figs, (), ("plan.json", "predicted-trace.json"))
