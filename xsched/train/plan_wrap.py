"""Capture, plan and wrap the model of one `xsched train` run, Twin-Flow's optimizer split included."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from xsched.contracts.graph import Graph
from xsched.devices.spec import target_device_type
from xsched.loaders import TrainingTask
from xsched.train import dist
from xsched.train.config import TrainConfig
from xsched.train.plans import CachedPlan, cached_plan
from xsched.train.records import Reporter


def local_device(name: str, local_rank: int) -> str:
    """The device name on this rank: "cuda" is the rank's own GPU."""
    return f"cuda:{local_rank}" if name == "cuda" else name


def graph_name(spec: str) -> str:
    """A file-name-safe name for the model's graph: gpt2 for zoo:gpt2, hf-gpt2 for hf:gpt2, my_model.factory for
    path/my_model.py:factory."""
    if spec.startswith("zoo:"):
        return spec[4:]
    if spec.startswith("hf:"):
        return f"hf-{spec[3:]}"
    path, _, factory = spec.rpartition(":")
    return f"{Path(path).stem}.{factory}"


def grad_outputs(task: TrainingTask) -> str | tuple[int, ...]:
    """The model outputs whose gradients a step computes: those the task's loss function reads (found on fake
    tensors), so a model returning (logits, loss) trained on its loss captures no backward of its logits; every
    output where that cannot be found."""
    from xsched.capture.grad_outputs import loss_outputs

    inputs, targets = task.example_batch
    return loss_outputs(task.model, tuple(inputs), task.loss_fn, targets) or "all"


def plan_and_wrap(
    config: TrainConfig,
    task: TrainingTask,
    budgets: dict[str, str],
    devices: Sequence[str],
    world: dist.World,
    rep: Reporter,
    evaluates: bool,
    lap: Callable[[str], None] | None = None,
) -> tuple[Graph, CachedPlan, Any]:
    """Capture under the run's autocast (so the casts are in the graph and the plan runs the low-precision ops),
    plan (rank 0 first: the others find its cached plans) and wrap; an evaluating run also gets an inference plan
    within the training plan's bytes (a "%" budget is of the training graph's eager peak). `lap(stage)` is called as
    each stage ends (loss outputs, capture, plan, split, wrap, eval plan: SetupLaps)."""
    from xsched.capture.chunk_loss import chunked_as_asked
    from xsched.capture.torch import capture
    from xsched.execute.param_home import param_homes
    from xsched.execute.wrap import wrap

    home = local_device(config.param_home, dist.local_rank()) if config.param_home else None
    stores = [local_device(d, dist.local_rank()) for d in config.stores]

    def plan_for(graph: Graph, limits: Mapping[str, str | int], homes: Mapping[str, str] | None = None) -> CachedPlan:
        if homes is None and home is not None:
            homes = param_homes(graph, home)
        return dist.main_first(
            world,
            lambda: cached_plan(
                graph,
                limits,
                devices,
                config.method,
                config.profile,
                config.time_limit,
                config.cache_dir,
                rep.notice,
                stores,
                homes,
                fused=config.compile,
                gap=config.gap,
            ),
        )

    def ended(stage: str) -> None:
        if lap is not None:
            lap(stage)

    inputs = task.example_batch[0]
    grads = grad_outputs(task)
    ended("loss outputs")
    typed = target_device_type([*devices, *stores])  # wrap types its graphs by the same devices: the plans fit
    # a body of many identical blocks is traced cut to a few and extrapolated: the same graph, checked
    name = graph_name(config.model)
    graph = capture(task.model, inputs, name=name, grad_outputs=grads, reuse_blocks=True, device_type=typed)
    graph = chunked_as_asked(graph, config.chunk_loss)
    ended("capture")
    chosen = plan_for(graph, budgets)
    ended("plan")
    if config.optimizer_split is not None and home is not None:
        chosen, budgets = _split(config, graph, chosen, budgets, devices, stores, home, plan_for, rep, world)
        ended("split")
    wrapped = wrap(
        task.model,
        inputs,
        budgets,
        devices,
        plan=chosen.plan,
        stores=stores,
        param_home=home,
        compile=config.compile,
        grad_outputs=grads,
        expandable_segments=config.expandable_segments,
        planned_addresses=config.planned_addresses,
        chunk_loss=config.chunk_loss,
        issue=config.issue,
    )
    ended("wrap")
    if evaluates:
        wrapped.eval()
        inference = capture(task.model, inputs, inference=True, name=graph.name, reuse_blocks=True, device_type=typed)
        with torch.no_grad():  # the evaluation's calls: eval mode without grad (an inference plan)
            wrapped.use_plan(plan_for(inference, chosen.plan.budgets).plan, inputs)
        wrapped.train()
        ended("eval plan")
    return graph, chosen, wrapped


def _split(
    config: TrainConfig,
    graph: Graph,
    chosen: CachedPlan,
    budgets: dict[str, str],
    devices: Sequence[str],
    stores: Sequence[str],
    home: str,
    plan_for: Callable[..., CachedPlan],
    rep: Reporter,
    world: dist.World,
) -> tuple[CachedPlan, dict[str, Any]]:
    """Twin-Flow's split (xsched.train.placement): the parameters the all-home plan releases last move, with their
    optimizer, to the computing device within `--optimizer-split` of its budget, and the plan is solved again."""
    from xsched.budgets import format_bytes
    from xsched.execute.param_home import ListenerSlot, ParamPoints, param_homes
    from xsched.train.placement import split_plan

    device = next(d for d in devices if d not in stores and d != home)  # config.check: there is one
    order = ParamPoints(graph, chosen.plan, ListenerSlot()).order
    homes = param_homes(graph, home)
    assert config.optimizer_split is not None
    if config.optimizer_split == "auto":
        return _auto_split(config, graph, chosen, budgets, device, home, homes, plan_for, rep, world)
    pick, why = None, None
    if config.optimizer_split_by == "time":
        pick, why = _timed_pick(graph, chosen, device, home, budgets, adamw_rates(config, home, device, world))
    share = float(config.optimizer_split)
    split, plan = split_plan(graph, order, device, budgets, share, lambda b, h: plan_for(graph, b, h), homes, pick)
    rep.notice(
        f"optimizer split: {len(split.params)} of {len(order)} parameters and their AdamW on {device} "
        f"({format_bytes(split.bytes)} with their state), the rest on {home}{why(split) if why else ''}"
    )
    return plan, dict(split.budgets)  # type: ignore[return-value]


def _auto_split(
    config: TrainConfig,
    graph: Graph,
    chosen: CachedPlan,
    budgets: dict[str, str],
    device: str,
    home: str,
    homes: Mapping[str, str],
    plan_for: Callable[..., CachedPlan],
    rep: Reporter,
    world: dist.World,
) -> tuple[CachedPlan, dict[str, Any]]:
    """`--optimizer-split auto` (xsched.train.split_auto): the share chosen from the room the all-home plan leaves,
    and a notice of the share, the predicted steps with and without, and why it stopped there."""
    from xsched.budgets import format_bytes
    from xsched.train.split_auto import choose_auto

    rates = adamw_rates(config, home, device, world)
    auto = choose_auto(graph, chosen, device, home, budgets, homes, rates, lambda b, h: plan_for(graph, b, h))
    count = sum(1 for v in graph.inputs if graph.value[v].kind == "param")
    rep.notice(
        f"optimizer split auto: share {auto.share:.3g} of {device}'s budget, {len(auto.split.params)} of {count} "
        f"parameters and their AdamW on {device} ({format_bytes(auto.split.bytes)} with their state); predicted "
        f"step {auto.step_s * 1e3:.4g} ms, {auto.before_s * 1e3:.4g} ms with nothing moved; stopped: {auto.stopped} "
        f"(room {format_bytes(auto.room)}: the budget less the all-home plan's peak and "
        f"{format_bytes(auto.margin)} of modelled fragmentation; AdamW {rates[0] / 1e9:.3g} Gparam/s on {home}, "
        f"{rates[1] / 1e9:.3g} on {device})"
    )
    return auto.planned, dict(auto.split.budgets)  # type: ignore[return-value]


def adamw_rates(config: TrainConfig, home: str, device: str, world: dist.World) -> tuple[float, float]:
    """AdamW's rates (parameters/s) on the home and the computing device: the configured ones, else measured on
    rank 0 and broadcast, so every rank chooses the same split (ranks measuring their own would differ, and
    parameters updated by AdamW on different devices would drift apart by rounding)."""
    if config.adamw_rates is not None:
        return config.adamw_rates
    from xsched.train.split_inputs import adamw_rate

    measured = (adamw_rate(home), adamw_rate(device)) if world.main else None
    return dist.broadcast(measured, world)  # type: ignore[return-value]


def _timed_pick(
    graph: Graph,
    chosen: CachedPlan,
    device: str,
    home: str,
    budgets: dict[str, str],
    rates: tuple[float, float],
) -> tuple[Callable[[float], Any], Callable[[Any], str]]:
    """The split by predicted step (xsched.train.split_time) on the all-home plan's predicted run and AdamW's
    `rates` (on the home, on the device), and what it predicts for a split, in words."""
    from xsched.train.placement import choose_timed
    from xsched.train.split_inputs import plan_groups
    from xsched.train.split_time import StepModel, predict_step

    groups, run_s = plan_groups(graph, chosen.plan, chosen.profile)
    model = StepModel(run_s, *rates)
    before = predict_step(groups, (), model)[0]

    def pick(share: float) -> Any:
        return choose_timed(graph, groups, model, device, budgets, share)

    def why(split: Any) -> str:
        moved = [i for i, g in enumerate(groups) if set(g.params) <= set(split.params)]
        return (
            f"; chosen by predicted step: {predict_step(groups, moved, model)[0] * 1e3:.4g} ms, "
            f"{before * 1e3:.4g} ms with nothing moved (run {run_s * 1e3:.4g} ms; AdamW "
            f"{model.host_rate / 1e9:.2f} Gparam/s on {home}, {model.device_rate / 1e9:.2f} on {device})"
        )

    return pick, why
