"""Setup of `xsched train --param-home cpu --store cpu --method park` as the session itself runs it (issue 30 item 4),
without a GPU: `xsched.train.session.prepare` on logical CPU devices (cpu:0 computes within --budget, cpu:1 is the
host: the parameters' home and the store) on modelled costs, each of its stages timed as it ends.

    python scripts/bench_setup_session.py [--model gpt2] [--scale full:n_layer=48,...] [--budget 16GiB] [--cache DIR]

Prints the wall and this process's CPU seconds of the stages before the first step: the model and its data, the
loss's outputs (a fake forward), the capture, the plan (cached in --cache: a second run finds it), wrap (its capture
reused, its bindings and executor), the host optimizer's buckets, then prepare() in all. The stages after
the model are the GPU run's, but for the measured profile and the pinned host memory (CUDA only)."""

from __future__ import annotations

import argparse
import functools
import importlib
import tempfile
import time
from collections.abc import Callable
from typing import Any

from bench_setup_plan import SCALE

import xsched.capture.torch as capture_torch
import xsched.train.plan_wrap as plan_wrap
import xsched.train.session as session
from xsched.train import dist
from xsched.train.config import TrainConfig
from xsched.train.records import Quiet


def timed(owner: Any, name: str, label: str) -> Callable[[], None]:
    """`owner.name` replaced by itself printing its seconds under `label` each time it returns; undo with the result."""
    real = getattr(owner, name)

    @functools.wraps(real)
    def run(*args: Any, **kwargs: Any) -> Any:
        wall, cpu = time.perf_counter(), time.process_time()
        try:
            return real(*args, **kwargs)
        finally:
            took = f"{time.perf_counter() - wall:7.1f} s wall {time.process_time() - cpu:7.1f} s cpu"
            print(f"{label:10} {took}", flush=True)

    setattr(owner, name, run)
    return lambda: setattr(owner, name, real)


def stages() -> list[Callable[[], None]]:
    """Every stage of prepare() timed (the names it calls them by: plan_and_wrap imports capture and wrap inside)."""
    wrap_module = importlib.import_module("xsched.execute.wrap")  # xsched.execute's `wrap` is the function
    return [
        timed(session, "load_task", "model"),
        timed(plan_wrap, "grad_outputs", "loss outs"),
        timed(capture_torch, "capture", "capture"),
        timed(plan_wrap, "cached_plan", "plan"),
        timed(wrap_module, "wrap", "wrap"),
        timed(session, "make_updater", "optimizer"),
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt2", help="a zoo model")
    ap.add_argument("--scale", default=SCALE)
    ap.add_argument("--budget", default="16GiB", help="cpu:0's budget, the GPU's stand-in")
    ap.add_argument("--cache", help="the plan cache (default: a new folder, so the plan is solved)")
    args = ap.parse_args()
    cache = args.cache or tempfile.mkdtemp(prefix="xsched-setup-")
    config = TrainConfig(
        f"zoo:{args.model}",
        {"cpu:0": args.budget, "cpu:1": "100GiB"},
        steps=1,
        scale=args.scale,
        method="park",
        profile="model",
        cache_dir=cache,
        param_home="cpu:1",
        stores=("cpu:1",),
    )
    undo = stages()
    wall, cpu = time.perf_counter(), time.process_time()
    try:
        budgets, devices = session.placement(config, 0)
        prepared, _ = session.prepare(config, budgets, devices, dist.join(use_cuda=False), Quiet(0))
        print(f"{'prepare':10} {time.perf_counter() - wall:7.1f} s wall {time.process_time() - cpu:7.1f} s cpu")
        prepared.updater.close()
    finally:
        for restore in undo:
            restore()


if __name__ == "__main__":
    main()
