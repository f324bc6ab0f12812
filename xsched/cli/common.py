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


def parse_shape_flags(flags: Sequence[str]) -> dict[str, tuple[int, ...]]:
    """`--shape NAME=1x3x224x224` (repeatable) -> {input name: dims}: the symbolic dimensions of an ONNX model."""
    from xsched.capture.onnx import parse_shape

    out = {}
    for f in flags:
        name, sep, dims = f.rpartition("=")
        if not sep or not name:
            raise XschedError(f"--shape wants INPUT=DIMS, e.g. input=1x3x224x224; got {f!r}", stage="cli")
        out[name.strip()] = parse_shape(dims)
    return out


def add_shape_flag(parser: Any) -> None:
    parser.add_argument("--shape", action="append", default=[], metavar="INPUT=DIMS",
                        help="ONNX models: bind an input's symbolic dimensions, e.g. input=1x3x224x224 (repeatable)")  # fmt: skip


def print_json(data: Any) -> None:
    print(json.dumps(data, indent=1, default=str))
