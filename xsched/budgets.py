"""Budget strings per device: "4GiB", "16GB", "123" (bytes) or "50%" of the eager plan's peak."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping

from xsched.errors import BudgetError

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*|%)\s*$")


def parse_budget(
    spec: str | int | float, eager_peak: Callable[[], int] | int | None = None, device: str | None = None
) -> int:
    """Bytes for one budget. A percentage needs `eager_peak` (bytes, or a function computing it)."""
    if isinstance(spec, bool):
        raise BudgetError(f"budget must be bytes or a string, got {spec!r}", device=device)
    if isinstance(spec, int):
        if spec < 0:
            raise BudgetError(f"budget must be non-negative, got {spec}", device=device)
        return spec
    m = _PATTERN.match(str(spec))
    if not m:
        raise BudgetError(f"cannot parse budget {spec!r}: write e.g. 4GiB, 16GB, 1048576 or 50%", device=device)
    number, unit = float(m.group(1)), m.group(2).lower()
    if unit == "%":
        if eager_peak is None:
            raise BudgetError(f"budget {spec!r} is relative to the eager peak, which is unknown here", device=device)
        peak = eager_peak() if callable(eager_peak) else eager_peak
        return int(peak * number / 100)
    if unit not in _UNITS:
        raise BudgetError(f"unknown unit {m.group(2)!r} in budget {spec!r}", device=device)
    return int(number * _UNITS[unit])


def parse_budgets(
    specs: Mapping[str, str | int | float], eager_peak: Callable[[], int] | int | None = None
) -> dict[str, int]:
    """Bytes per device for a `max_memory`-style mapping; the eager peak is computed at most once."""
    cache: list[int] = []

    def peak() -> int:
        if not cache:
            cache.append(eager_peak() if callable(eager_peak) else int(eager_peak or 0))
        return cache[0]

    return {d: parse_budget(s, peak if eager_peak is not None else None, d) for d, s in specs.items()}


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n} B"
