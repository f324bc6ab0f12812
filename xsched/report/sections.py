"""The report's data sections (budget sweep, device what-if, energy, measured frontier): each one's figure, tables
and the CSV/JSON it writes beside report.html."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from xsched.budgets import format_bytes
from xsched.errors import XschedError
from xsched.report import data, energy, html, plots
from xsched.report.draw import fmt_seconds
from xsched.report.machines import Machine
from xsched.report.sweep import SweepSettings


def save(out: Path, files: dict[str, Path], stem: str, rows: list[dict[str, Any]], raw: Any) -> tuple[str, str]:
    files[f"{stem}.csv"] = data.write_csv(out / f"{stem}.csv", rows)
    files[f"{stem}.json"] = data.write_json(out / f"{stem}.json", raw)
    return f"{stem}.csv", f"{stem}.json"


def sweep_section(sweeps: list, s: SweepSettings, machine: Machine, out: Path, files: dict) -> html.Section:
    points = [p for x in sweeps for p in x.points]
    names = save(out, files, "sweep", [data.row(p) for p in points], sweeps)
    m0 = s.methods[0]
    acc = [d for d in machine.devices if any(d in p.planned_bytes for p in points)]  # those the allocator model runs on
    header = (
        "budget",
        *(f"{m} makespan" for m in s.methods),
        f"{m0} status",
        f"{m0} sequential time",
        f"{m0} energy",
        *(f"{m0} peak {d}" for d in machine.devices),
        *(c for d in acc for c in (f"{m0} reserved {d}, expandable segments", f"{m0} reserved {d}, planned addresses")),
    )
    tables = tuple(
        html.Table(
            f"{x.machine}: budget of {x.label} (the other devices at their base budgets)",
            header,
            data.sweep_cells(x.points, s.methods, machine.devices, acc),
        )
        for x in sweeps
    )
    fig = html.Figure(
        "fig-sweep",
        plots.sweep_figure(sweeps, s.methods),
        f"Predicted time per training iteration (the makespan: the devices' lanes overlapped, as the executor runs them) against each device's budget on {machine.label} ({s.method} "
        f"with {s.time_limit_s:g} s per plan, baselines {', '.join(s.baselines) or 'none'}); "
        "crosses on the axis: budgets where the solver found no plan. Dotted: the proven lower bound; dash-dotted: "
        "the peak of the plain eager schedule. eager: that schedule on the fastest single device it fits; greedy: "
        "accelerate-style, the devices filled in order; checkpoint: recomputation searched on one device.",
    )
    intro = (
        f"How much time each byte of budget buys. {plots.budget_note(points)}; the solver's plan and the "
        "baselines at each budget, every plan checked by the simulator. Beside a peak on an accelerator, the memory "
        "PyTorch's CUDA caching allocator is expected to reserve for the plan (a model, xsched.allocator; a range "
        "from the GPU keeping up with the host to the host a step ahead): what runs out on a GPU. Then the same "
        "with expandable segments (`--expandable-segments`), and with planned addresses (`--planned-addresses`: "
        "the step's values in one arena, its size beside it)."
    )
    return html.Section("sweep", "Budget sweep", intro, (fig,), tables, names)


def whatif_section(results: list, s: SweepSettings, out: Path, files: dict) -> html.Section:
    rows = [data.row(p) for r in results for p in (*r.points, *r.sweep.points)]
    names = save(out, files, "whatif", rows, results)
    m0 = s.methods[0]
    header = (
        "machine",
        *(f"{m} makespan" for m in s.methods),
        f"{m0} status",
        f"{m0} sequential time",
        f"{m0} energy",
        f"{m0} peaks",
        "base budgets",
    )
    sources = html.Table(
        "Where each machine's numbers come from",
        ("machine", "op costs per device", "energy"),
        tuple((r.machine.label, "; ".join(f"{d}: {c}" for d, c in r.sources.items()), r.energy) for r in results),
    )
    fig = html.Figure(
        "fig-whatif",
        plots.whatif_figure(results, s.method),
        "Left: predicted time (makespan) against the budget of each machine's accelerators (all set to it together; the other "
        "devices at their base budgets). Right: the fastest plan of each machine at its base budgets, its energy.",
    )
    intro = (
        "The same graph planned for each machine from one profile: measured costs where the device is this "
        "machine's, the roofline model of the device's spec where it is simulated."
    )
    table = html.Table("Each machine at its base budgets", header, data.machine_cells(results, s.methods))
    return html.Section("whatif", "Device what-if", intro, (fig,), (table, sources), names)


def energy_section(studies: list[energy.EnergyStudy], out: Path, files: dict) -> html.Section:
    rows = [{"machine": x.machine, **data.row(p)} for x in studies for p in x.points]
    names = save(out, files, "energy", rows, studies)
    sources = "; ".join(sorted({x.source for x in studies}))
    fig = html.Figure(
        "fig-energy",
        plots.energy_figure(studies),
        f"{sources}. Left: each machine's plans minimising time + alpha x energy for growing alpha "
        "(u: the fastest plan's time over its energy). Right: the fastest plan whose energy is within "
        "each cap; crosses: caps under which no plan was found.",
    )
    tables = []
    for x in studies:
        budgets = ", ".join(f"{d} {format_bytes(b)}" for d, b in x.budgets.items())
        tables.append(
            html.Table(
                f"{x.machine} at {budgets} ({x.source}; {energy.tradeoff(x)})",
                ("objective", "status", "makespan", "sequential time", "energy"),
                data.energy_cells(x),
            )
        )
    intro = (
        "What a joule costs in time on each machine at its base budgets, and what a time budget costs in "
        f"energy ({sources}: the profile's energy_source per device)."
    )
    return html.Section("energy", "Energy", intro, (fig,), tuple(tables), names)


def frontier_section(measured: Path, out: Path, files: dict) -> html.Section:
    """The measured frontier of a memory benchmark run: every row's step time against its step peak."""
    import json
    import shutil

    try:
        got = json.loads(measured.read_text())
        rows = got["rows"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise XschedError(f"--measured {measured}: not a bench_gpu_memory JSON ({e})", stage="report") from e
    files[measured.name] = out / measured.name
    if files[measured.name].resolve() != measured.resolve():
        shutil.copyfile(measured, files[measured.name])
    facts = got.get("facts", {})
    where = f"{facts.get('device', '?')}, graph {facts.get('graph', '?')}"
    fig = html.Figure(
        "fig-frontier",
        plots.frontier_figure(rows, where),
        "Measured step time against measured step peak (above what is resident) of every row of the memory "
        "benchmark: torch's own savers, torch.compile (plain and with activation_memory_budget) and xsched's plans.",
    )
    table = html.Table(
        "The rows",
        ("row", "step time", "step peak", "step reserved"),
        tuple(
            (
                r["plan"],
                r.get("error") or fmt_seconds(r.get("time_s")),
                bytes_text(r.get("peak")),
                bytes_text(r.get("reserved")),
            )
            for r in rows
        ),
    )
    intro = f"Measured by scripts/bench_gpu_memory.py ({facts.get('command', 'command not recorded')})."
    return html.Section("frontier", "Measured frontier", intro, (fig,), (table,), (measured.name,))


def bytes_text(n: int | None) -> str:
    return "-" if n is None else format_bytes(n)
