"""Matplotlib for the report, imported only when drawing: a figure, its inline SVG text, and axis formatters.

Figures are `matplotlib.figure.Figure` objects (no pyplot: no global state, no GUI backend) saved as SVG with
text kept as text, no date and a per-figure hash salt, so a report is reproducible and its ids do not collide.
"""

from __future__ import annotations

import io
from typing import Any

from xsched.errors import XschedError

MISSING = "the what-if report draws its plots with matplotlib, which is not installed: pip install xsched[report]"
# one colour per method / machine, the same everywhere in a report (matplotlib's tab10, colour-blind aware order)
COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f")


def require() -> None:
    """Raise a one-line XschedError telling how to install matplotlib when it is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as e:
        raise XschedError(MISSING, stage="report") from e


def figure(width: float, height: float) -> Any:
    require()
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), layout="constrained")


def to_svg(fig: Any, salt: str) -> str:
    """The figure as an <svg> element (no XML prologue), ready to inline in HTML."""
    import matplotlib

    buf = io.StringIO()
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": salt}):
        fig.savefig(buf, format="svg", metadata={"Date": None})
    text = buf.getvalue()
    return text[text.index("<svg") :]


def fmt_bytes(n: float) -> str:
    """Short byte labels for axes: 512 B, 96 KiB, 1.5 MiB, 40 GiB."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" or n >= 100 else f"{n:.3g} {unit}"
        n /= 1024
    return f"{n:.3g} TiB"


def byte_unit(values: list[float]) -> tuple[float, str]:
    """(divisor, unit) that shows bytes as B, KiB, MiB or GiB by the largest value: axes plot bytes / divisor, so
    the ticks fall on round numbers of the unit."""
    top = max(values, default=0.0)
    for k, unit in enumerate(("B", "KiB", "MiB", "GiB")):
        if top < 1024 ** (k + 1) or unit == "GiB":
            return float(1024**k), unit
    return float(1024**3), "GiB"


def fmt_seconds(s: float | None) -> str:
    if s is None:
        return "-"
    if s >= 1:
        return f"{s:.3g} s"
    if s >= 1e-3:
        return f"{s * 1e3:.3g} ms"
    return f"{s * 1e6:.3g} µs"


def time_unit(values: list[float]) -> tuple[float, str]:
    """(scale, unit) that shows seconds in s, ms or µs by the largest value."""
    top = max(values, default=1.0)
    if top >= 1:
        return 1.0, "s"
    if top >= 1e-3:
        return 1e3, "ms"
    return 1e6, "µs"
