"""Helpers the verbs share: budget flags, JSON output."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from xsched.errors import XschedError


def parse_budget_flags(flags: Sequence[str]) -> dict[str, str]:
    """`--budget DEVICE=SIZE` (repeatable) -> {device: size}."""
    out = {}
    for f in flags:
        dev, sep, spec = f.partition("=")
        if not sep:
            raise XschedError(f"--budget wants DEVICE=SIZE, got {f!r}", stage="cli")
        out[dev.strip()] = spec.strip()
    return out


def print_json(data: Any) -> None:
    print(json.dumps(data, indent=1, default=str))
