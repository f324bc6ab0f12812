"""`xsched train`: train a zoo model or a model file's factory within per-device budgets, on one process or under
torchrun, with checkpoints and resume."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Iterator
from typing import TextIO

from xsched.cli.common import parse_budget_flags


@contextlib.contextmanager
def json_stdout() -> Iterator[TextIO]:
    """A stream on the original stdout that carries only the JSON lines, while everything else written to stdout
    during the run (a solver library's banner from C, a factory's prints) goes to stderr."""
    sys.stdout.flush()
    saved = os.dup(1)
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield out
    finally:
        out.flush()
        out.close()
        os.dup2(saved, 1)
        os.close(saved)


def cmd_train(a: argparse.Namespace) -> int:
    from xsched.devices.base import split_device_list
    from xsched.train import TrainConfig, train
    from xsched.train.progress import Bar, JsonLines

    config = TrainConfig(
        model=a.model,
        budgets=parse_budget_flags(a.budget),
        steps=a.steps,
        lr=a.lr,
        optimizer=a.optimizer,
        batch=a.batch,
        scale=a.scale,
        devices=tuple(split_device_list(a.devices)) if a.devices else None,
        method=a.method,
        time_limit=a.time_limit,
        profile=a.profile,
        cache_dir=a.cache_dir,
        checkpoint_dir=a.checkpoint_dir,
        checkpoint_every=a.checkpoint_every,
        resume=a.resume,
        seed=a.seed,
    )
    if not a.json:
        train(config, Bar())
        return 0
    with json_stdout() as out:
        train(config, JsonLines(out))
    return 0


def add(sub: argparse._SubParsersAction) -> None:
    t = sub.add_parser(
        "train",
        help="train a model within per-device budgets (one process, or each rank under torchrun), with checkpoints",
        description="Plan once (cached under --cache-dir), then train through the plan. Under torchrun "
        "(torchrun --nproc-per-node N -m xsched.cli train ...) each rank plans for its own devices and the ranks "
        "train data-parallel; only rank 0 prints and writes checkpoints.",
    )
    t.add_argument("model", help="zoo:NAME (synthetic data, per-family loss) or path/to/file.py:factory")
    t.add_argument(
        "--budget",
        action="append",
        default=[],
        metavar="DEVICE=SIZE",
        help="per-device budget, e.g. cpu=16GiB or cuda=50%% (repeatable; bare 'cuda' is this rank's GPU)",
    )
    t.add_argument("--steps", type=int, default=100, help="total steps to reach (a resumed run trains the rest)")
    t.add_argument("--lr", type=float, default=1e-3)
    t.add_argument("--optimizer", default="adamw", help="adamw (default) or sgd (momentum 0.9)")
    t.add_argument("--batch", type=int, help="batch size per process (default: the model's)")
    t.add_argument("--scale", default="default", help="zoo size knob: tiny, small, default, full")
    t.add_argument("--devices", help="comma-separated devices (default: the budgets' devices)")
    t.add_argument("--method", default="auto", help="solver method (default auto)")
    t.add_argument("--time-limit", type=float, help="solver time limit in seconds (default 60)")
    t.add_argument(
        "--profile",
        default="measure",
        choices=("measure", "model"),
        help="plan on measured costs (default, cached) or modelled ones",
    )
    t.add_argument("--cache-dir", default="profiles", help="where profiles and plans are cached (default profiles/)")
    t.add_argument("--checkpoint-dir", help="folder for step-*.pt checkpoints (written by rank 0)")
    t.add_argument("--checkpoint-every", type=int, help="checkpoint every K steps (default 100; always at the end)")
    t.add_argument("--resume", action="store_true", help="resume from the newest checkpoint in --checkpoint-dir")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--json", action="store_true", help="one JSON object per line: start, step, checkpoint, end")
    t.set_defaults(run=cmd_train)
