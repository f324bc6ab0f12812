"""`xsched demo`: the whole pipeline on a zoo model."""

from __future__ import annotations

import argparse


def cmd_demo(a: argparse.Namespace) -> int:
    from xsched.demo import run_demo

    return run_demo(a.model, a.scale, a.gpu, a.gpu_budget, a.time_limit)


def add(sub: argparse._SubParsersAction) -> None:
    m = sub.add_parser("demo", help="the whole pipeline on a zoo model: capture, profile, solve, simulate, run")
    m.add_argument("--model", default="resnet18")
    m.add_argument("--scale", default="tiny")
    m.add_argument("--gpu", default="sim:rtx4090", help="a simulated GPU (sim:<spec>) or cuda:0")
    m.add_argument("--gpu-budget", default="4GiB")
    m.add_argument("--time-limit", type=float, default=20.0)
    m.set_defaults(run=cmd_demo)
