"""Setting up one `xsched train` run: load the task (zoo, factory or Hugging Face; token files), find the checkpoint
to resume, capture under the run's autocast, plan once (cached; an inference plan too when it evaluates), wrap,
and restore the checkpoint: model, optimizer, loss scaler and every rank's RNG states."""

from __future__ import annotations

import contextlib
import dataclasses
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch

from xsched.capture.reuse import captured_once
from xsched.contracts.graph import Graph
from xsched.contracts.plan import Compute, Plan
from xsched.errors import XschedError
from xsched.execute.step_clock import StepClock, lane_kinds
from xsched.loaders import Batch, TrainingTask, load_training_task
from xsched.train import dist
from xsched.train.checkpoint import newest_checkpoint, set_rng_state
from xsched.train.config import TrainConfig
from xsched.train.data import token_data
from xsched.train.meters import EnergyMeter, PeakMeter
from xsched.train.optim import Updater, autocast, host_optimizer_blocker, make_updater, master_on_host
from xsched.train.plan_wrap import local_device, plan_and_wrap
from xsched.train.plans import CachedPlan
from xsched.train.records import Reporter, SetupLaps

# what a checkpoint's run must share with the run resuming it (its seed and world may differ: see restore)
RESUME_KEYS = (
    "model",
    "scale",
    "hf_config",
    "inputs",
    "data",
    "optimizer",
    "precision",
    "grad_accum",
    "clip_grad",
    "weight_decay",
    "schedule",
    "delayed_update",
)


@dataclass(frozen=True)
class Session:
    """Everything the steps use: the task, the module to call (DDP or the wrapped one) and the wrapped one itself
    (evaluations call it directly), the updater, the plan, where the inputs go, the meters, the run's autocast,
    the validation batches, the token ids one micro-batch carries, and what a checkpoint records of the run."""

    task: TrainingTask
    model: torch.nn.Module
    wrapped: torch.nn.Module
    updater: Updater
    chosen: CachedPlan
    where: Mapping[int, torch.device]
    peaks: PeakMeter
    energy: EnergyMeter
    autocast: Callable[[], contextlib.AbstractContextManager]
    val: Callable[[int, int, int], Batch] | None
    tokens: int | None
    signature: Mapping[str, Any]
    clock: StepClock | None = None  # the per-step breakdown of the training plan's runs and the host optimizer
    setup: Mapping[str, float] = field(default_factory=dict)  # seconds of each stage of prepare() (SetupLaps)

    def sync(self, last: bool) -> contextlib.AbstractContextManager:
        """DDP's gradient all-reduce only on a step's last micro-batch (no_sync on the others)."""
        no_sync = getattr(self.model, "no_sync", None)
        return contextlib.nullcontext() if last or no_sync is None else no_sync()


def placement(config: TrainConfig, local_rank: int) -> tuple[dict[str, str], list[str]]:
    budgets = {local_device(d, local_rank): s for d, s in config.budgets.items()}
    devices = [local_device(d, local_rank) for d in config.devices] if config.devices else list(budgets)
    return budgets, devices


def load_task(config: TrainConfig) -> TrainingTask:
    """The model and its data: zoo:NAME, hf:TYPE or file.py:factory, its batches from --data when given."""
    if config.model.startswith("hf:"):
        from xsched.train.hf import hf_task

        task = hf_task(
            config.model, config.hf_config, config.pretrained, config.batch, config.seq_len, config.seed, config.lora
        )
    else:
        task = load_training_task(config.model, config.batch, config.scale, config.seed)
    if config.data is not None:
        task = dataclasses.replace(task, batches=token_data(task, config.data, config.seed, "train"))
    return task


def input_devices(graph: Graph, plan: Plan) -> dict[int, torch.device]:
    """Position of each tensor input of the model -> the torch device its plan home is on."""
    from xsched.execute.reference import torch_device

    out = {}
    for vid in graph.inputs:
        v = graph.value[vid]
        if v.kind == "input":
            out[int((v.name or "").split(":")[1])] = torch_device(plan.homes[vid])
    return out


def run_signature(config: TrainConfig, task: TrainingTask, updater: Updater, world: dist.World) -> dict[str, Any]:
    """What a checkpoint records of its run, to refuse resuming it with other settings (RESUME_KEYS)."""
    shapes = [list(x.shape) for x in task.example_batch[0] if isinstance(x, torch.Tensor)]
    return {
        "model": config.model,
        "scale": config.scale,
        "hf_config": config.hf_config,
        "inputs": shapes,
        "data": Path(config.data).name if config.data else None,
        "optimizer": config.optimizer,
        "precision": config.precision,
        "grad_accum": config.grad_accum,
        "clip_grad": config.clip_grad,
        "weight_decay": updater.weight_decay,
        "schedule": updater.schedule.describe(),
        "delayed_update": True if config.delayed_update else None,  # None: as checkpoints from before the flag
        "seed": config.seed,
        "world": world.size,
    }


def resume(config: TrainConfig, world: dist.World, notice: Any) -> tuple[int, dict[str, Any] | None]:
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


def restore(
    state: dict[str, Any],
    task: TrainingTask,
    updater: Updater,
    signature: Mapping[str, Any],
    world: dist.World,
    notice: Any,
) -> None:
    """The checkpoint's model, optimizer, loss scaler and this rank's RNG states, if its run had these settings."""
    saved = dict(state.get("run", {}))
    for key in RESUME_KEYS:
        if saved.get(key) != signature[key]:
            raise XschedError(
                f"the checkpoint's run has {key}={saved.get(key)!r}, this run {signature[key]!r}", stage="train"
            )
    task.model.load_state_dict(state["model"])
    updater.load_state_dict(state)
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


def step_clock(wrapped: Any) -> StepClock:
    """A clock on the training plan's executor: its lanes by kind (a copy into a computing device is in)."""
    ex = wrapped._first.executor
    clock = StepClock()
    computes = {s.device for s in ex.plan.steps if isinstance(s, Compute)}
    clock.kind_of = lane_kinds(ex.lane_of, computes)
    ex.clock = clock
    return clock


def issuing_threads(wrapped: Any) -> int:
    """The threads that issue the training plan's steps: this one and, where its executor runs on lanes (a thread
    each, not `issue="one"`), each lane's but the free lanes' (a free takes no time to issue)."""
    ex = wrapped._first.executor
    lanes = ex.overlap and ex.issue == "lanes"
    return 1 + (sum(not key.startswith("free:") for key in ex.lanes) if lanes else 0)


def _token_count(task: TrainingTask) -> int | None:
    first = next((x for x in task.example_batch[0] if isinstance(x, torch.Tensor)), None)
    return first.numel() if first is not None and not first.is_floating_point() else None


def prepare(
    config: TrainConfig, budgets: dict[str, str], devices: Sequence[str], world: dist.World, rep: Reporter
) -> tuple[Session, int]:
    """Load the task, find the checkpoint to resume, plan and wrap, and restore the checkpoint or seed the training
    draws. Returns the session and the first step to run."""
    from xsched.execute.reference import torch_device

    laps = SetupLaps()
    torch.manual_seed(config.seed)  # the factory's initial weights: the same on every rank
    task = load_task(config)
    if master_on_host(config, world.size):  # bf16 weights for the run; their fp32 masters go to the host optimizer
        task.model.to(torch.bfloat16)
    val = token_data(task, config.val_data, config.seed, "val") if config.val_data else None
    task.model.train()  # a factory may hand over a model in eval mode: training captures the training graph
    start, state = resume(config, world, rep.notice)
    laps.lap("model")
    kinds = tuple(sorted({torch_device(d).type for d in devices}))
    amp = partial(autocast, config.precision, kinds)
    with amp(), captured_once():  # wrap's capture of the model and inputs just captured for planning reuses it
        graph, chosen, wrapped = plan_and_wrap(config, task, budgets, devices, world, rep, val is not None, laps.lap)
    clock = step_clock(wrapped)
    updater = make_updater(config, wrapped, kinds, world.size, clock, issuing_threads(wrapped))
    laps.lap("optimizer")
    wrapped.pin_host_memory()  # after the host optimizer pinned the buffers it packs the weights into
    laps.lap("pin")
    blocker = host_optimizer_blocker(config, world.size)
    if config.param_home is not None and blocker is not None and world.main:
        unused = " (--host-threads and --host-nice size the overlapped one: unused)"
        shared = config.host_threads is not None or config.host_nice is not None
        rep.notice(
            f"the optimizer steps on {config.param_home} after the backward, not overlapped: {blocker}"
            + (unused if shared else "")
        )
    signature = run_signature(config, task, updater, world)
    if state is not None:
        restore(state, task, updater, signature, world, rep.notice)
    else:
        torch.manual_seed(config.seed + world.rank)  # the training draws (dropout), restored as they are on resume
        random.seed(config.seed + world.rank)
    plan = chosen.plan
    torch_devices = {d: torch_device(d) for d in plan.devices}
    session = Session(
        task,
        dist.data_parallel(wrapped, world),
        wrapped,
        updater,
        chosen,
        input_devices(wrapped.graph, plan),
        PeakMeter(plan, torch_devices),
        EnergyMeter(plan, chosen.profile, torch_devices),
        amp,
        val,
        _token_count(task),
        signature,
        clock,
    )
    laps.lap("restore")
    session = dataclasses.replace(session, setup=laps.stages)
    rep.start(
        {
            "model": config.model,
            "world": world.size,
            "devices": list(devices),
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
            "precision": config.precision,
            "grad_accum": config.grad_accum,
            "schedule": updater.schedule.describe(),
            "param_home": config.param_home,
            "optimizer_overlap": updater.overlap is not None,
            "host_share": getattr(getattr(updater, "host", None), "share_note", None),
            "delayed_update": config.delayed_update,
            "master_weights": "fp32 on the host" if master_on_host(config, world.size) else None,
            "profile": chosen.profile,
            "setup_stages": dict(laps.stages),
        }
    )
    return session, start
