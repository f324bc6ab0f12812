"""Helpers the verbs share: budget flags, JSON output, a progress bar for jobs that run against a time limit."""

from __future__ import annotations

import argparse
import json
import math
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from xsched.errors import XschedError


def seconds(text: str) -> float:
    """An argparse type: a finite, positive number of seconds (--time-limit)."""
    x = _number(text)
    if not math.isfinite(x) or x <= 0:
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds above 0, got {text!r}")
    return x


def cap_seconds(text: str) -> float:
    """An argparse type: a finite number of seconds, 0 included (--max-time 0: measure nothing, model every op)."""
    x = _number(text)
    if not math.isfinite(x) or x < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds, 0 or more, got {text!r}")
    return x


def relative_gap(text: str) -> float:
    """An argparse type: a relative gap in [0, 1) (--gap)."""
    x = _number(text)
    if not 0 <= x < 1:
        raise argparse.ArgumentTypeError(f"must be a relative gap in [0, 1), got {text!r}")
    return x


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None


def parse_budget_flags(flags: Sequence[str]) -> dict[str, str]:
    """`--budget DEVICE=SIZE` (repeatable) -> {device: size}."""
    out = {}
    for f in flags:
        dev, sep, spec = f.partition("=")
        if not sep or not dev.strip() or not spec.strip():
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
    parser.add_argument(
        "--shape",
        action="append",
        default=[],
        metavar="INPUT=DIMS",
        help="ONNX models: bind an input's symbolic dimensions, e.g. input=1x3x224x224 (repeatable)",
    )


def print_json(data: Any) -> None:
    print(json.dumps(data, indent=1, default=str))


def quiet(args: Any) -> bool:
    """No progress bars: asked for, or the output is JSON for a program, or stderr is not a terminal."""
    return bool(getattr(args, "quiet", False) or getattr(args, "json", False) or not sys.stderr.isatty())


@contextmanager
def timed_progress(desc: str, limit_s: float | None, disable: bool) -> Iterator[None]:
    """A bar of elapsed seconds against `limit_s` while the body runs (a solver reports nothing until it returns, so
    the bar shows how much of its time limit is spent); it closes at the time actually taken."""
    if disable or not limit_s:
        yield
        return
    from tqdm import tqdm

    done = threading.Event()
    bar = tqdm(
        total=round(limit_s),
        desc=desc,
        unit="s",
        leave=False,
        file=sys.stderr,
        bar_format="{desc}: {bar} {n:.0f}/{total:.0f} s",
    )
    t0 = time.perf_counter()

    def tick() -> None:
        while not done.wait(0.5):
            bar.n = min(time.perf_counter() - t0, limit_s)
            bar.refresh()

    thread = threading.Thread(target=tick, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
        bar.close()
