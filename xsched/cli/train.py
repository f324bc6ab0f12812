"""`xsched train`: train a zoo model, a model file's factory or a Hugging Face model within per-device budgets, on
one process or under torchrun: mixed precision, gradient accumulation, clipping, learning-rate schedules, token
files with validation, checkpoints and resume."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Iterator
from typing import TextIO

from xsched.cli.common import parse_budget_flags, seconds
from xsched.lanes import ISSUE_MODES


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
        gap=a.gap,
        profile=a.profile,
        cache_dir=a.cache_dir,
        checkpoint_dir=a.checkpoint_dir,
        checkpoint_every=a.checkpoint_every,
        resume=a.resume,
        seed=a.seed,
        precision=a.precision,
        grad_accum=a.grad_accum,
        clip_grad=a.clip_grad,
        weight_decay=a.weight_decay,
        lr_schedule=a.lr_schedule,
        warmup=a.warmup,
        min_lr=a.min_lr,
        data=a.data,
        val_data=a.val_data,
        eval_every=a.eval_every,
        eval_batches=a.eval_batches,
        hf_config=a.config,
        pretrained=a.pretrained,
        seq_len=a.seq_len,
        lora=a.lora,
        log_csv=a.log_csv,
        param_home=a.param_home,
        stores=tuple(split_device_list(",".join(a.store))) if a.store else (),
        compile=a.compile,
        expandable_segments=a.expandable_segments,
        planned_addresses=a.planned_addresses,
        delayed_update=a.delayed_update,
        optimizer_split=a.optimizer_split,
        optimizer_split_by=a.optimizer_split_by,
        trace=a.trace,
        chunk_loss=a.chunk_loss,
        host_threads=a.host_threads,
        host_nice=a.host_nice,
        issue=a.issue,
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
    t.add_argument(
        "model",
        help="zoo:NAME (synthetic data, per-family loss), hf:TYPE (a transformers causal LM, e.g. hf:gpt2) or "
        "path/to/file.py:factory",
    )
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
    t.add_argument(
        "--param-home",
        metavar="DEVICE",
        help="where the parameters, gradients and AdamW state live, e.g. cpu beside a GPU; AdamW runs there, "
        "overlapped with the backward (default: the first device)",
    )
    t.add_argument(
        "--store",
        action="append",
        default=[],
        metavar="DEVICE",
        help="a device that holds values and runs no op (only its copies are profiled), e.g. cpu; repeatable",
    )
    t.add_argument("--method", default="auto", help="solver method (default auto)")
    t.add_argument("--time-limit", type=seconds, help="solver time limit in seconds (default 60)")
    t.add_argument(
        "--gap", type=float, help="stop planning once the plan is within this relative gap of the lower bound"
    )
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
    t.add_argument("--compile", action="store_true", help="run each one-device run of steps as one compiled region")
    t.add_argument(
        "--expandable-segments",
        action="store_true",
        help="turn on PyTorch's CUDA expandable_segments before the plan's first allocation (a no-op on CPU devices)",
    )
    t.add_argument(
        "--planned-addresses",
        action="store_true",
        help="the step's values at planned offsets in one preallocated buffer per device (outputs and gradients outside)",
    )
    t.add_argument("--json", action="store_true", help="one JSON object per line: start, step, checkpoint, end")
    t.add_argument("--log-csv", metavar="PATH", help="also write each step's fields (as --json's step lines) to a CSV")
    _add_training_flags(t)
    _add_data_flags(t)
    _add_lora_flags(t)
    _add_offload_flags(t)
    t.set_defaults(run=cmd_train)


def _add_lora_flags(t: argparse.ArgumentParser) -> None:
    t.add_argument(
        "--lora",
        metavar="r=R,alpha=A,targets=NAME,...|DIR",
        help="hf: models: train LoRA adapters on the frozen model (e.g. r=8,alpha=16,targets=q_proj,v_proj, or a "
        "folder of saved adapters to train further); they are saved under --checkpoint-dir/adapter as "
        "PeftModel.from_pretrained loads them. Needs peft: pip install 'xsched[lora]'",
    )


def split_share(text: str) -> float | str:
    """--optimizer-split's value: auto, a number, or the text as given (TrainConfig.check refuses it in one line)."""
    if text == "auto":
        return text
    try:
        return float(text)
    except ValueError:
        return text


def thread_count(text: str) -> int | str:
    """--host-threads' value: all, a whole number, or the text as given (TrainConfig.check refuses it in one line)."""
    try:
        return int(text)
    except ValueError:
        return text


def _add_offload_flags(t: argparse.ArgumentParser) -> None:
    t.add_argument(
        "--delayed-update",
        action="store_true",
        help="with --param-home: apply each AdamW update one step late (ZeRO-Offload's delayed parameter update), "
        "so the next step never waits for the host optimizer; every gradient is then one update stale",
    )
    t.add_argument(
        "--optimizer-split",
        type=split_share,
        metavar="SHARE|auto",
        help="with --param-home: home the parameters the backward finishes last on the computing device, with "
        "their AdamW state, within SHARE (0-1) of its budget (ZeRO-Offload++'s Twin-Flow); the rest stay home. "
        "auto: the planner chooses the share, from the room the plan with every parameter home leaves in the "
        "budget, and the parameters, by predicted step (as --optimizer-split-by time)",
    )
    t.add_argument(
        "--optimizer-split-by",
        choices=("order", "time"),
        default="order",
        help="with --optimizer-split: which parameters move within SHARE: 'order', those the backward releases "
        "last; 'time', those whose move gives the least predicted step (the host AdamW, at its measured rate, "
        "modelled as work the next forward's reads wait for)",
    )
    t.add_argument(
        "--host-threads",
        type=thread_count,
        metavar="N|all",
        help="with --param-home: the host optimizer's CPU threads (all: torch's count); default beside a GPU, the "
        "cores the threads issuing the plan leave, so a lane never waits for a core; else torch's count",
    )
    t.add_argument(
        "--host-nice",
        type=int,
        metavar="N",
        help="with --param-home: raise the host optimizer's nice value by N (0-19, Linux), so a lane ready to issue "
        "runs before it; default 10 beside a GPU, else 0",
    )
    t.add_argument(
        "--issue",
        choices=ISSUE_MODES,
        default="lanes",
        help="who issues a GPU plan's overlapped steps: lanes (default), a thread per CUDA stream; one, the training "
        "thread, every step in plan order onto its stream with the same waits (no hand-offs between threads)",
    )
    t.add_argument(
        "--trace",
        metavar="PATH",
        help="write a Chrome trace of the last step: the plan's lanes (GPU time on CUDA streams), the runs, the "
        "host optimizer's buckets and the waits for them",
    )


def _add_training_flags(t: argparse.ArgumentParser) -> None:
    t.add_argument(
        "--precision",
        default="fp32",
        help="fp32 (default), bf16 or fp16: autocast captured into the plan (fp16 with loss scaling)",
    )
    t.add_argument("--grad-accum", type=int, default=1, metavar="K", help="micro-batches per optimizer step")
    t.add_argument(
        "--chunk-loss",
        type=int,
        metavar="K",
        help="compute the cross-entropy and its backward in K row blocks (no [tokens, vocab] tensor but the logits)",
    )
    t.add_argument("--clip-grad", type=float, metavar="NORM", help="clip the gradients' total norm to NORM")
    t.add_argument(
        "--weight-decay",
        type=float,
        help="decay of the weights (2+ dimensions; not biases or norms); default AdamW 0.01, SGD 0",
    )
    t.add_argument(
        "--lr-schedule", default="constant", help="constant (default), cosine or linear decay to --min-lr over --steps"
    )
    t.add_argument("--warmup", type=int, default=0, metavar="N", help="linear warmup over the first N steps")
    t.add_argument("--min-lr", type=float, default=0.0, help="the rate cosine and linear decay end at (default 0)")


def _add_data_flags(t: argparse.ArgumentParser) -> None:
    t.add_argument("--data", metavar="PATH", help="training tokens: a uint16 .bin (nanoGPT's layout) or a 1-D .npy")
    t.add_argument("--val-data", metavar="PATH", help="validation tokens, the same layout")
    t.add_argument("--eval-every", type=int, metavar="N", help="evaluate every N steps and at the end (default 100)")
    t.add_argument("--eval-batches", type=int, help="validation batches per evaluation (default 8)")
    t.add_argument("--config", metavar="KEY=VALUE,...", help="hf: models: config values over the type's defaults")
    t.add_argument("--pretrained", metavar="DIR", help="hf: models: load the weights save_pretrained wrote in DIR")
    t.add_argument("--seq-len", type=int, help="hf: models: tokens per sequence (default: the model's context)")
