"""`xsched demo`: the whole main job on a zoo model, with a what-if report and a plan trained for real."""

from __future__ import annotations

import argparse

from xsched.cli.common import quiet, seconds
from xsched.demo import DemoSettings


def cmd_demo(a: argparse.Namespace) -> int:
    from xsched.demo import run_demo

    settings = DemoSettings(a.model, a.scale, a.gpu, a.cpu_budget, a.output, a.time_limit, progress=not quiet(a))
    return run_demo(settings)


def add(sub: argparse._SubParsersAction) -> None:
    d = DemoSettings()
    m = sub.add_parser("demo", help="the whole pipeline on a zoo model: capture, profile, report, plan, train, check")
    m.add_argument("model", nargs="?", default=d.model, help=f"zoo model name (default {d.model})")
    m.add_argument("--scale", default=d.scale, help=f"zoo size knob (default {d.scale})")
    m.add_argument(
        "--gpu",
        default=d.gpu,
        help="cuda:0, or a simulated GPU sim:<spec> (default: cuda:0 if present, else sim:rtx4090)",
    )
    m.add_argument("--cpu-budget", default=d.cpu_budget, help="budget of the plan trained for real on the CPU")
    m.add_argument("-o", "--output", default=d.out, help=f"folder for the report (default {d.out})")
    m.add_argument("--time-limit", type=seconds, default=d.time_limit_s, help="seconds per plan in the report")
    m.add_argument("--quiet", action="store_true", help="no progress bars")
    m.set_defaults(run=cmd_demo)
