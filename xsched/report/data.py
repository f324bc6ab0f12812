"""The report's numbers beside its page: rows of the sweeps, what-ifs and energy studies as CSV and JSON, and the
table cells the page shows."""

from __future__ import annotations

import csv
import dataclasses
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from xsched.report.draw import fmt_bytes, fmt_seconds
from xsched.report.energy import EnergyStudy
from xsched.report.sweep import Point
from xsched.report.whatif import MachineResult


def row(obj: Any) -> dict[str, Any]:
    """A frozen dataclass as a flat row: mappings as 'key=value;...' (CSV), None as empty."""
    out = {}
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        if isinstance(v, Mapping):
            v = ";".join(f"{k}={x}" for k, x in v.items())
        out[f.name] = "" if v is None else v
    return out


def plain(obj: Any) -> Any:
    """A dataclass (or nested lists and mappings of them) as JSON-ready data; non-finite floats as None."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: plain(getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.compare}
    if isinstance(obj, Mapping):
        return {str(k): plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [plain(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj


def write_csv(path: Path, rows: Sequence[Mapping[str, Any]]) -> Path:
    fields = list(dict.fromkeys(k for r in rows for k in r))
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        w.writerows(rows)
    return path


def write_json(path: Path, data: Any) -> Path:
    path.write_text(json.dumps(plain(data), indent=1, allow_nan=False) + "\n")
    return path


def _energy(j: float | None) -> str:
    return "-" if j is None else f"{j:.4g} J"


def _status(p: Any) -> str:
    if p.ok:
        return p.status + (f" ({p.found_by})" if p.found_by and p.found_by != getattr(p, "method", None) else "")
    return p.status


def _peak(p: Point, device: str) -> str:
    """The plan's peak on `device`, and on an accelerator the reserved memory the caching allocator model expects."""
    peak, reserved = p.peak_bytes.get(device, 0), p.reserved_bytes.get(device)
    if reserved is None or not peak:
        return fmt_bytes(peak)
    return f"{fmt_bytes(peak)} (reserved ~{_range(reserved)})"


def _range(pair: tuple[int, int] | None) -> str:
    """A (GPU keeping up, host ahead) pair of reserved bytes: one figure, or low-high."""
    if pair is None:
        return "-"
    low, high = (fmt_bytes(b) for b in pair)
    return low if low == high else f"{low}-{high}"


def _planned(p: Point, device: str) -> str:
    """Reserved with planned addresses on `device`, and the arena's share of it."""
    if device not in p.planned_bytes:
        return "-"
    return f"{_range(p.planned_bytes[device])} (arena {fmt_bytes(p.arena_bytes.get(device, 0))})"


def sweep_cells(
    points: Sequence[Point], methods: Sequence[str], devices: Sequence[str], accelerators: Sequence[str] = ()
) -> tuple[tuple[str, ...], ...]:
    """One row per budget: each method's makespan (or why it has no plan), then the first method's status, sequential time,
    energy and peak on each device (with the reserved memory the allocator model expects on an accelerator), then on
    each of `accelerators` its reserved memory with expandable segments and with planned addresses."""
    by = {(p.budget_bytes, p.method): p for p in points}
    rows = []
    for b in sorted({p.budget_bytes for p in points}):
        times = [
            fmt_seconds(p.step_s) if (p := by.get((b, m))) is not None and p.ok else p.status if p else "-"
            for m in methods
        ]
        main = by.get((b, methods[0]))
        if main is None or not main.ok:
            rest = ["-"] * (3 + len(devices) + 2 * len(accelerators))
        else:
            rest = [
                _status(main),
                fmt_seconds(main.time_s),
                _energy(main.energy_j),
                *(_peak(main, d) for d in devices),
                *(c for d in accelerators for c in (_range(main.expandable_bytes.get(d)), _planned(main, d))),
            ]
        rows.append((fmt_bytes(b), *times, *rest))
    return tuple(rows)


def machine_cells(results: Sequence[MachineResult], methods: Sequence[str]) -> tuple[tuple[str, ...], ...]:
    """One row per machine at its base budgets: each method's makespan, then the first method's status, sequential time,
    energy and peaks, and the budgets."""
    rows = []
    for r in results:
        by = {p.method: p for p in r.points}
        times = [fmt_seconds(by[m].step_s) if by[m].ok else by[m].status for m in methods]
        main = by[methods[0]]
        peaks = ", ".join(f"{d} {_peak(main, d)}" for d in main.peak_bytes) or "-"
        budgets = ", ".join(f"{d} {fmt_bytes(b)}" for d, b in r.budgets.items())
        rows.append(
            (
                r.machine.label,
                *times,
                _status(main),
                fmt_seconds(main.time_s),
                _energy(main.energy_j),
                peaks,
                budgets,
            )
        )
    return tuple(rows)


def energy_cells(study: EnergyStudy) -> tuple[tuple[str, ...], ...]:
    rows = []
    for p in study.points:
        what = f"alpha = {p.alpha:.3g} s/J" if p.kind == "alpha" else f"cap {p.cap_j:.4g} J"
        rows.append((what, _status(p), fmt_seconds(p.step_s), fmt_seconds(p.time_s), _energy(p.energy_j)))
    return tuple(rows)
