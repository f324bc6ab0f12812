"""The training loop of `xsched train`: load the task, plan once (cached on disk), train through the wrapped module
(DistributedDataParallel across torchrun's ranks), checkpoint every K steps, and resume from the newest checkpoint
with the same loss curve as an uninterrupted run."""

from __future__ import annotations

import random
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from torch.utils._pytree import tree_leaves, tree_map

from xsched.budgets import parse_budget
from xsched.contracts.graph import Graph
from xsched.contracts.plan import Plan
from xsched.errors import XschedError
from xsched.loaders import TrainingTask, load_training_task
from xsched.train import dist
from xsched.train.checkpoint import newest_checkpoint, rng_state, save_checkpoint, set_rng_state
from xsched.train.meters import EnergyMeter, PeakMeter
from xsched.train.plans import CachedPlan, cached_plan

OPTIMIZERS = ("adamw", "sgd")
DEFAULT_CHECKPOINT_EVERY = 100


@dataclass(frozen=True)
class TrainConfig:
    """One training run. `batch` is per process; `steps` is the total to reach (a resumed run trains the rest).
    A bare `cuda` in `budgets` or `devices` is this process's GPU (cuda:LOCAL_RANK under torchrun)."""

    model: str
    budgets: Mapping[str, str]
    steps: int = 100
    lr: float = 1e-3
    optimizer: str = "adamw"
    batch: int | None = None
    scale: str = "default"
    devices: tuple[str, ...] | None = None
    method: str = "auto"
    time_limit: float | None = None
    profile: str = "measure"
    cache_dir: str = "profiles"
    checkpoint_dir: str | None = None
    checkpoint_every: int | None = None  # default DEFAULT_CHECKPOINT_EVERY when checkpoint_dir is given
    resume: bool = False
    seed: int = 0

    def check(self) -> None:
        """A one-line XschedError for each value that cannot work, before anything is loaded."""

        def fail(message: str) -> None:
            raise XschedError(message, stage="train")

        if not self.budgets:
            fail("give at least one budget: --budget DEVICE=SIZE, e.g. cpu=8GiB or cuda=80%")
        for device, size in self.budgets.items():
            parse_budget(size, eager_peak=1, device=device)  # the syntax only; "%" is resolved when planning
        if self.steps < 1:
            fail(f"--steps must be at least 1, got {self.steps}")
        if not self.lr > 0:
            fail(f"--lr must be positive, got {self.lr}")
        if self.optimizer not in OPTIMIZERS:
            fail(f"--optimizer must be one of {', '.join(OPTIMIZERS)}, got {self.optimizer!r}")
        if self.batch is not None and self.batch < 1:
            fail(f"--batch must be at least 1, got {self.batch}")
        if self.checkpoint_every is not None and self.checkpoint_dir is None:
            fail("--checkpoint-every needs --checkpoint-dir")
        if self.checkpoint_every is not None and self.checkpoint_every < 1:
            fail(f"--checkpoint-every must be at least 1, got {self.checkpoint_every}")
        if self.resume and self.checkpoint_dir is None:
            fail("--resume needs --checkpoint-dir (the folder of a run's step-*.pt files)")


@dataclass(frozen=True)
class StepRecord:
    """One step: its 0-based index (its data is batches(step, rank, world)), the loss averaged over the ranks
    (the combined batch's loss), rank 0's wall time, peak bytes per device and energy, each with its source."""

    step: int
    loss: float
    step_s: float
    peak_bytes: Mapping[str, int]
    peak_source: Mapping[str, str]
    energy_j: float | None
    energy_source: str


@dataclass(frozen=True)
class TrainResult:
    start_step: int  # the step this run began at (0, or the resumed checkpoint's)
    records: tuple[StepRecord, ...]
    plan_path: Path
    plan_reused: bool
    checkpoint: Path | None  # the last checkpoint written (rank 0), if any
    world: int = 1
    time_s: float = 0.0  # the steps' wall time
    setup_s: float = 0.0  # loading, capturing, planning (or finding the cached plan), resuming

    @property
    def losses(self) -> list[float]:
        return [r.loss for r in self.records]


class Reporter(Protocol):
    """Where a run's progress goes (rank 0 only): xsched.train.progress has a bar and JSON lines."""

    def start(self, info: Mapping[str, Any]) -> None: ...
    def step(self, record: StepRecord) -> None: ...
    def checkpoint(self, step: int, path: Path) -> None: ...
    def notice(self, text: str) -> None: ...
    def end(self, result: TrainResult) -> None: ...
    def close(self) -> None: ...  # also after a failure: the error is then printed on a line of its own


class Quiet:
    """No progress; notices still go to stderr as one line each, naming the rank when it is not rank 0."""

    def __init__(self, rank: int = 0) -> None:
        self.prefix = f"xsched train [rank {rank}]" if rank else "xsched train"

    def start(self, info: Mapping[str, Any]) -> None: ...
    def step(self, record: StepRecord) -> None: ...
    def checkpoint(self, step: int, path: Path) -> None: ...
    def end(self, result: TrainResult) -> None: ...
    def close(self) -> None: ...

    def notice(self, text: str) -> None:
        print(f"{self.prefix}: {text}", file=sys.stderr, flush=True)


def _local(name: str, local_rank: int) -> str:
    return f"cuda:{local_rank}" if name == "cuda" else name


def _placement(config: TrainConfig, local_rank: int) -> tuple[dict[str, str], list[str]]:
    budgets = {_local(d, local_rank): s for d, s in config.budgets.items()}
    devices = [_local(d, local_rank) for d in config.devices] if config.devices else list(budgets)
    return budgets, devices


def graph_name(spec: str) -> str:
    """A file-name-safe name for the model's graph: gpt2 for zoo:gpt2, my_model.factory for path/my_model.py:factory."""
    if spec.startswith("zoo:"):
        return spec[4:]
    path, _, factory = spec.rpartition(":")
    return f"{Path(path).stem}.{factory}"


def _input_devices(graph: Graph, plan: Plan) -> dict[int, torch.device]:
    """Position of each tensor input of the model -> the torch device its plan home is on."""
    from xsched.execute.reference import torch_device

    out = {}
    for vid in graph.inputs:
        v = graph.value[vid]
        if v.kind == "input":
            out[int((v.name or "").split(":")[1])] = torch_device(plan.homes[vid])
    return out


def _place(inputs: Sequence[Any], where: Mapping[int, torch.device]) -> tuple[Any, ...]:
    return tuple(x.to(where[i]) if isinstance(x, torch.Tensor) and i in where else x for i, x in enumerate(inputs))


def _loss(task: TrainingTask, outputs: Any, targets: Any) -> torch.Tensor:
    """loss_fn(outputs, targets), the targets first moved to the outputs' device; a non-scalar is an error."""
    first = next((t for t in tree_leaves(outputs) if isinstance(t, torch.Tensor)), None)
    if first is not None:
        targets = tree_map(lambda t: t.to(first.device) if isinstance(t, torch.Tensor) else t, targets)
    loss = task.loss_fn(outputs, targets)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        got = f"a tensor of shape {list(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise XschedError(f"{task.name}: loss_fn returned {got}; it must return a scalar tensor", stage="train")
    return loss.reshape(())


def _optimizer(config: TrainConfig, params: Iterator[torch.nn.Parameter]) -> torch.optim.Optimizer:
    if config.optimizer == "sgd":
        return torch.optim.SGD(params, lr=config.lr, momentum=0.9)
    return torch.optim.AdamW(params, lr=config.lr)


def _run_signature(config: TrainConfig, task: TrainingTask, world: dist.World) -> dict[str, Any]:
    """What a checkpoint must agree on to resume it: the model, its input shapes, the optimizer, the seed."""
    shapes = [list(x.shape) for x in task.example_batch[0] if isinstance(x, torch.Tensor)]
    return {
        "model": config.model,
        "scale": config.scale,
        "inputs": shapes,
        "optimizer": config.optimizer,
        "seed": config.seed,
        "world": world.size,
    }


def _resume(config: TrainConfig, world: dist.World, notice: Any) -> tuple[int, dict[str, Any] | None]:
    """The checkpoint every rank resumes from (each reads the shared folder; they must agree on the step)."""
    if not config.resume:
        return 0, None
    assert config.checkpoint_dir is not None
    step, state = dist.main_first(world, lambda: newest_checkpoint(config.checkpoint_dir, notice))
    steps = dist.gather(step, world)
    if len(set(steps)) != 1:
        raise XschedError(
            f"ranks found different newest checkpoints {steps} in {config.checkpoint_dir}; "
            "is the folder shared by every rank?",
            stage="train",
        )
    return step, state


def _restore(
    state: dict[str, Any],
    task: TrainingTask,
    opt: torch.optim.Optimizer,
    signature: dict[str, Any],
    world: dist.World,
    notice: Any,
) -> None:
    saved = dict(state.get("run", {}))
    for key in ("model", "scale", "inputs", "optimizer"):
        if saved.get(key) != signature[key]:
            raise XschedError(
                f"the checkpoint's run has {key}={saved.get(key)!r}, this run {signature[key]!r}", stage="train"
            )
    task.model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    rngs = state.get("rng", [])
    if saved.get("world") == world.size and world.rank < len(rngs):
        set_rng_state(rngs[world.rank])
    else:
        if world.main:
            notice(
                f"checkpoint of {saved.get('world')} ranks resumed on {world.size}: the data split and "
                "random streams differ from an uninterrupted run"
            )
        torch.manual_seed(signature["seed"] + world.rank + 7919 * int(state["step"]))  # fresh, per rank and step


def train(config: TrainConfig, reporter: Reporter | None = None) -> TrainResult:
    """Run `config`: plan (cached), train, checkpoint; under torchrun, one rank of data-parallel training."""
    config.check()
    budgets, devices = _placement(config, dist.local_rank())
    world = dist.join(use_cuda=any(d.startswith("cuda") for d in devices))
    rep = reporter if reporter is not None and world.main else Quiet(world.rank)
    try:
        t0 = time.perf_counter()
        session, start = _prepare(config, budgets, devices, world, rep)
        result = _loop(config, session, world, rep, start, time.perf_counter() - t0)
        del session  # DDP's reducer holds the process group: it must go before `leave` (see there)
        dist.barrier(world)  # leave together: rank 0 may still be writing the last checkpoint
        return result
    finally:
        rep.close()
        dist.leave(world)


@dataclass(frozen=True)
class _Session:
    """Everything the steps use: the task, the module to call (DDP or the wrapped one), its optimizer, where the
    inputs go, the meters, and what a checkpoint records about the run."""

    task: TrainingTask
    model: torch.nn.Module
    opt: torch.optim.Optimizer
    chosen: CachedPlan
    where: Mapping[int, torch.device]
    peaks: PeakMeter
    energy: EnergyMeter
    signature: Mapping[str, Any]


def _prepare(
    config: TrainConfig, budgets: dict[str, str], devices: list[str], world: dist.World, rep: Reporter
) -> tuple[_Session, int]:
    """Load the task, find the checkpoint to resume, plan (rank 0 first: the others find its cached plan), wrap,
    and restore the checkpoint or seed the training draws. Returns the session and the first step to run."""
    from xsched.capture.torch import capture
    from xsched.execute.reference import torch_device
    from xsched.execute.wrap import wrap

    torch.manual_seed(config.seed)  # the factory's initial weights: the same on every rank
    task = load_training_task(config.model, config.batch, config.scale, config.seed)
    task.model.train()  # a factory may hand over a model in eval mode: training captures the training graph
    start, state = _resume(config, world, rep.notice)
    inputs = task.example_batch[0]
    graph = capture(task.model, inputs, name=graph_name(config.model))
    chosen: CachedPlan = dist.main_first(
        world,
        lambda: cached_plan(
            graph, budgets, devices, config.method, config.profile, config.time_limit, config.cache_dir, rep.notice
        ),
    )
    plan = chosen.plan
    wrapped = wrap(task.model, inputs, budgets, devices, plan=plan)
    opt = _optimizer(config, wrapped.parameters())
    signature = _run_signature(config, task, world)
    if state is not None:
        _restore(state, task, opt, signature, world, rep.notice)
    else:
        torch.manual_seed(config.seed + world.rank)  # the training draws (dropout), restored as they are on resume
        random.seed(config.seed + world.rank)
    torch_devices = {d: torch_device(d) for d in plan.devices}
    session = _Session(
        task,
        dist.data_parallel(wrapped, world),
        opt,
        chosen,
        _input_devices(wrapped.graph, plan),
        PeakMeter(plan, torch_devices),
        EnergyMeter(plan, chosen.profile, torch_devices),
        signature,
    )
    rep.start(
        {
            "model": config.model,
            "world": world.size,
            "devices": devices,
            "budgets": dict(plan.budgets),
            "graph": graph,
            "plan": plan,
            "plan_path": str(chosen.path),
            "plan_reused": chosen.reused,
            "profile_path": str(chosen.profile_path) if chosen.profile_path else None,
            "start_step": start,
            "steps": config.steps,
            "resumed_from": config.checkpoint_dir if config.resume else None,
            "energy_source": session.energy.source,
        }
    )
    return session, start


def _step(s: _Session, step: int, world: dist.World) -> StepRecord:
    """One optimizer step on this rank's batch of `step`; the loss is averaged over the ranks."""
    inputs, targets = s.task.batch(step, world.rank, world.size)
    inputs = _place(inputs, s.where)
    s.peaks.start()
    s.energy.start()
    t0 = time.perf_counter()
    loss = _loss(s.task, s.model(*inputs), targets)
    s.opt.zero_grad(set_to_none=True)
    loss.backward()  # under DDP, the gradients are averaged over the ranks as autograd accumulates them
    s.opt.step()
    s.peaks.sync()
    dt = time.perf_counter() - t0
    return StepRecord(
        step, dist.mean(loss, world), dt, s.peaks.read(), s.peaks.source, s.energy.read(), s.energy.source
    )


def _save(s: _Session, directory: str, done: int, world: dist.World) -> Path | None:
    """The checkpoint after `done` steps, written by rank 0 with every rank's RNG states (None on other ranks)."""
    rngs = dist.gather(rng_state(), world)
    if not world.main:
        return None
    return save_checkpoint(
        directory,
        done,
        {
            "step": done,
            "model": s.task.model.state_dict(),
            "optimizer": s.opt.state_dict(),
            "rng": rngs,
            "data": {"next_step": done, "world": world.size},
            "run": dict(s.signature),
        },
    )


def _loop(
    config: TrainConfig, s: _Session, world: dist.World, rep: Reporter, start: int, setup_s: float
) -> TrainResult:
    every = config.checkpoint_every or DEFAULT_CHECKPOINT_EVERY
    records: list[StepRecord] = []
    last: Path | None = None
    t0 = time.perf_counter()
    for step in range(start, config.steps):
        records.append(_step(s, step, world))
        rep.step(records[-1])
        done = step + 1
        if config.checkpoint_dir is not None and (done % every == 0 or done == config.steps):
            last = _save(s, config.checkpoint_dir, done, world)
            if last is not None:
                rep.checkpoint(done, last)
    result = TrainResult(
        start, tuple(records), s.chosen.path, s.chosen.reused, last, world.size, time.perf_counter() - t0, setup_s
    )
    rep.end(result)
    return result
