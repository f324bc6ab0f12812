"""The training loop of `xsched train`: each optimizer step runs `grad_accum` micro-batches forward (under the
run's autocast) and backward through the wrapped module (DistributedDataParallel across torchrun's ranks, which
all-reduces on the last micro-batch only), then one update (xsched.train.optim); every K steps it evaluates and
checkpoints, and a resumed run follows the same loss curve as an uninterrupted one.

Micro-batch m of rank r at step s is the task's batch (s, r·K + m, world·K): the K micro-batches of the world's
ranks are the rows of one global batch, so K micro-batches of b rows see what one step of K·b rows sees, and the
data stays a pure function of (step, rank, micro-batch)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.utils._pytree import tree_leaves, tree_map

from xsched.errors import XschedError
from xsched.loaders import TrainingTask
from xsched.report.trace import write_trace
from xsched.train import dist
from xsched.train.checkpoint import rng_state, save_checkpoint
from xsched.train.config import DEFAULT_CHECKPOINT_EVERY, DEFAULT_EVAL_BATCHES, DEFAULT_EVAL_EVERY, TrainConfig
from xsched.train.lora import save_adapters
from xsched.train.progress import CsvLog, Tee
from xsched.train.records import Quiet, Reporter, StepRecord, TrainResult
from xsched.train.session import Session, placement, prepare


def train(config: TrainConfig, reporter: Reporter | None = None) -> TrainResult:
    """Run `config`: plan (cached), train, evaluate, checkpoint; under torchrun, one rank of data-parallel
    training. Rank 0 reports to `reporter` (and to the CSV log of `config.log_csv`)."""
    config.check()
    budgets, devices = placement(config, dist.local_rank())
    world = dist.join(use_cuda=any(d.startswith("cuda") for d in devices))
    rep = reporter if reporter is not None and world.main else Quiet(world.rank)
    if config.log_csv is not None and world.main:
        rep = Tee(rep, CsvLog(config.log_csv))
    try:
        t0 = time.perf_counter()
        session, start = prepare(config, budgets, devices, world, rep)
        try:
            result = _loop(config, session, world, rep, start, time.perf_counter() - t0)
        finally:
            session.updater.close()  # a host optimizer's last updates land first
        del session  # DDP's reducer holds the process group: it must go before `leave` (see there)
        dist.barrier(world)  # leave together: rank 0 may still be writing the last checkpoint
        return result
    finally:
        rep.close()
        dist.leave(world)


def _place(inputs: Sequence[Any], where: Mapping[int, torch.device]) -> tuple[Any, ...]:
    return tuple(x.to(where[i]) if isinstance(x, torch.Tensor) and i in where else x for i, x in enumerate(inputs))


def task_loss(task: TrainingTask, outputs: Any, targets: Any) -> torch.Tensor:
    """loss_fn(outputs, targets), the targets first moved to the outputs' device; a non-scalar is an error."""
    first = next((t for t in tree_leaves(outputs) if isinstance(t, torch.Tensor)), None)
    if first is not None:
        targets = tree_map(lambda t: t.to(first.device) if isinstance(t, torch.Tensor) else t, targets)
    loss = task.loss_fn(outputs, targets)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        got = f"a tensor of shape {list(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise XschedError(f"{task.name}: loss_fn returned {got}; it must return a scalar tensor", stage="train")
    return loss.reshape(())


def _step(s: Session, step: int, world: dist.World, k: int) -> StepRecord:
    """One optimizer step on this rank's k micro-batches of `step`; the loss is averaged over them and the ranks."""
    s.peaks.start()
    s.energy.start()
    if s.clock is not None:
        s.clock.start()
    t0 = time.perf_counter()
    s.updater.start(step)
    losses = []
    for micro in range(k):
        inputs, targets = s.task.batch(step, world.rank * k + micro, world.size * k)
        inputs = _place(inputs, s.where)
        with s.sync(last=micro == k - 1):  # under DDP, gradients are averaged over the ranks on the last one
            with s.autocast():
                loss = task_loss(s.task, s.model(*inputs), targets)
            s.updater.backward(loss / k, micro, k)
        losses.append(loss.detach().float())
    lr, grad_norm = s.updater.step(step)
    s.peaks.sync()
    dt = time.perf_counter() - t0
    breakdown = s.clock.read() if s.clock is not None else None
    return StepRecord(
        step=step,
        loss=dist.mean(torch.stack(losses).mean(), world),
        lr=lr,
        grad_norm=grad_norm,
        step_s=dt,
        tokens_per_s=s.tokens * k * world.size / dt if s.tokens is not None and dt > 0 else None,
        peak_bytes=s.peaks.read(),
        peak_source=s.peaks.source,
        energy_j=s.energy.read(),
        energy_source=s.energy.source,
        loss_scale=s.updater.loss_scale,
        breakdown=breakdown,
    )


def evaluate(s: Session, world: dist.World, batches: int) -> float:
    """The mean loss of the validation batches 0..batches-1 (the same ones every time; each rank takes its rows),
    in eval mode and without gradients, by the inference plan."""
    assert s.val is not None
    s.wrapped.eval()
    try:
        losses = []
        with torch.no_grad(), s.autocast():
            for i in range(batches):
                inputs, targets = s.val(i, world.rank, world.size)
                losses.append(task_loss(s.task, s.wrapped(*_place(inputs, s.where)), targets).float())
    finally:
        s.wrapped.train()
    return dist.mean(torch.stack(losses).mean(), world)


def _save(s: Session, directory: str, done: int, world: dist.World) -> Path | None:
    """The checkpoint after `done` steps, written by rank 0 with every rank's RNG states (None on other ranks)."""
    rngs = dist.gather(rng_state(), world)
    if not world.main:
        return None
    s.updater.settle()  # a host optimizer may still be updating the parameters it holds
    save_adapters(s.task.model, directory)  # LoRA: the adapters as peft loads them, beside the checkpoints
    return save_checkpoint(
        directory,
        done,
        {
            "step": done,
            "model": s.task.model.state_dict(),
            **s.updater.state_dict(),  # the optimizer and the fp16 loss scaler; the schedule's position is `step`
            "rng": rngs,
            "data": {"next_step": done, "world": world.size},
            "run": dict(s.signature),
        },
    )


def _loop(config: TrainConfig, s: Session, world: dist.World, rep: Reporter, start: int, setup_s: float) -> TrainResult:
    every = config.checkpoint_every or DEFAULT_CHECKPOINT_EVERY
    eval_every = config.eval_every or DEFAULT_EVAL_EVERY
    records: list[StepRecord] = []
    last: Path | None = None
    t0 = time.perf_counter()
    for step in range(start, config.steps):
        record = _step(s, step, world, config.grad_accum)
        done = step + 1
        if s.val is not None and (done % eval_every == 0 or done == config.steps):
            record = dataclasses.replace(
                record, val_loss=evaluate(s, world, config.eval_batches or DEFAULT_EVAL_BATCHES)
            )
        records.append(record)
        rep.step(record)
        if config.checkpoint_dir is not None and (done % every == 0 or done == config.steps):
            last = _save(s, config.checkpoint_dir, done, world)
            if last is not None:
                rep.checkpoint(done, last)
    s.updater.settle()
    if s.clock is not None:
        s.clock.settled()  # the last step's updates, run past its close, belong in its trace
    t1 = time.perf_counter()
    if config.trace is not None and s.clock is not None and records:
        write_trace(s.clock.trace(f"{config.model}: step {records[-1].step}"), config.trace)
    result = TrainResult(
        start,
        tuple(records),
        s.chosen.path,
        s.chosen.reused,
        last,
        world.size,
        t1 - t0,
        setup_s,
        s.updater.overlap,
        dict(s.setup),
    )
    rep.end(result)
    return result
