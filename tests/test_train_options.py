"""`xsched train`'s training options against plain PyTorch training: bf16 autocast captured into the plan, fp16
with torch.amp.GradScaler (skipped steps, scale restored on resume), gradient accumulation, clipping against
clip_grad_norm_, schedules against LambdaLR and torch's own schedulers, and a resume mid-schedule."""

from __future__ import annotations

import csv
import dataclasses
import math

import pytest
import torch
from torch.testing import assert_close
from train_support import EXAMPLE, assert_same_weights, eager_run, eager_train

from xsched import zoo
from xsched.capture.torch import capture
from xsched.contracts.plan import Compute, Plan
from xsched.train import TrainConfig, train
from xsched.train.checkpoint import checkpoint_path, read_checkpoint
from xsched.train.schedule import Schedule
from xsched.zoo import tasks

pytestmark = pytest.mark.usefixtures("one_thread")


def gpt2_batches(scale: str, batch: int):
    return lambda step: tasks.task_batch("gpt2", scale, batch, step)


def test_bf16_autocast_is_captured_and_trains_like_eager_autocast(tmp_path) -> None:
    """GPT-2 (small) at 70% of its eager peak in bf16: the plan is made for the autocast graph (its matmuls in
    bf16) and recomputes, and every step's loss equals eager bf16 autocast training (dropout included)."""
    config = TrainConfig(
        "zoo:gpt2",
        {"cpu": "70%"},
        steps=3,
        scale="small",
        precision="bf16",
        method="checkpoint",
        profile="model",
        cache_dir=str(tmp_path),
        checkpoint_dir=str(tmp_path / "ck"),
    )
    result = train(config)
    z = zoo.build("gpt2", scale="small")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        graph = capture(z.model, z.inputs, grad_outputs=(1,))  # as train captures it: its loss is output 1
    plan = Plan.load(result.plan_path)
    assert (
        plan.graph == graph.fingerprint
        and graph.fingerprint != capture(z.model, z.inputs, grad_outputs=(1,)).fingerprint
    )
    assert any(v.dtype == "bfloat16" for v in graph.values)
    assert sum(isinstance(s, Compute) for s in plan.steps) > len({s.op for s in plan.steps if isinstance(s, Compute)})
    want = eager_train(z.model, gpt2_batches("small", 4), tasks.task_loss("gpt2"), 3, precision="bf16")
    assert result.losses == want["loss"]  # deterministic CPU kernels: bit for bit
    assert_same_weights(read_checkpoint(tmp_path / "ck", 3)["model"], want["model"], rtol=1e-6, atol=1e-7)


FP16 = """
import torch
from torch import nn

def factory(batch=16):
    model = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 4))
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(batch, 8, generator=gen), torch.randn(batch, 4, generator=gen)
    # large enough that the first steps overflow fp16 at GradScaler's initial scale, and then fit
    return model, ((x,), y), lambda out, y: (out.float() - y).pow(2).sum() * 0.3
"""


def test_fp16_loss_scaling_skips_overflowing_steps_and_resumes_its_scale(tmp_path) -> None:
    """fp16 with loss scaling as torch.amp.GradScaler does it: the first steps overflow, are skipped and lower
    the scale; a run resumed after them continues with the lowered scale, on the uninterrupted run's curve."""
    (tmp_path / "m.py").write_text(FP16)
    ck = tmp_path / "ck"
    config = TrainConfig(
        f"{tmp_path}/m.py:factory",
        {"cpu": "100%"},
        steps=5,
        lr=1e-2,
        precision="fp16",
        method="sqrt",
        profile="model",
        cache_dir=str(tmp_path),
        checkpoint_dir=str(ck),
        checkpoint_every=2,
        log_csv=str(tmp_path / "log.csv"),
    )
    whole = train(config)
    torch.manual_seed(0)
    spec = {}
    exec(FP16, spec)
    model, ((x,), y), loss_fn = spec["factory"]()
    want = eager_train(model, lambda step: ((x,), y), loss_fn, 5, lr=1e-2, precision="fp16")
    scales = [r.loss_scale for r in whole.records]
    assert scales == want["loss_scale"] and scales[0] < 65536.0 and scales[-1] == scales[-2]  # skips, then steps
    assert [math.isfinite(r.grad_norm) for r in whole.records] == [math.isfinite(n) for n in want["grad_norm"]]
    assert_close(whole.losses, want["loss"], rtol=1e-6, atol=1e-6)
    assert read_checkpoint(ck, 4)["scaler"]["scale"] == scales[3]

    checkpoint_path(ck, 5).unlink()
    checkpoint_path(ck, 4).unlink()
    train(dataclasses.replace(config, steps=2))  # a run stopped after two steps (both skipped): its checkpoint
    resumed = train(dataclasses.replace(config, resume=True))
    assert resumed.start_step == 2 and [r.loss_scale for r in resumed.records] == scales[2:]
    assert_close(resumed.losses, whole.losses[2:], rtol=0, atol=0)
    with open(tmp_path / "log.csv", newline="") as f:  # the stopped run's rows, then the resumed run's
        rows = list(csv.DictReader(f))
    assert [(int(r["step"]), float(r["loss"]), float(r["loss_scale"])) for r in rows] == [
        (r.step, r.loss, r.loss_scale) for r in whole.records
    ]
    assert_same_weights(read_checkpoint(ck, 5)["model"], want["model"], rtol=1e-5, atol=1e-6)


def test_two_micro_batches_of_b_equal_one_step_of_2b(tmp_path) -> None:
    """--grad-accum 2 at batch 16 trains as batch 32 does (the MLP has no batch statistics, and its loss is a mean
    over rows, so the mean of the two halves' losses and gradients is the whole batch's), and as plain PyTorch."""
    common = dict(steps=3, method="sqrt", profile="model", cache_dir=str(tmp_path))
    halves = train(TrainConfig(f"{EXAMPLE}:factory", {"cpu": "100%"}, batch=16, grad_accum=2, **common))
    whole = train(TrainConfig(f"{EXAMPLE}:factory", {"cpu": "100%"}, batch=32, **common))
    want, _ = eager_run(EXAMPLE, batch=32, world=1, steps=3)
    assert_close(halves.losses, whole.losses, rtol=1e-6, atol=1e-7)
    assert_close(halves.losses, want, rtol=1e-5, atol=1e-6)
    assert [r.grad_norm for r in halves.records] == pytest.approx([r.grad_norm for r in whole.records], rel=1e-5)


def cosine_factor(warmup: int, steps: int, floor: float):
    """The cosine schedule with linear warmup, written out as a LambdaLR factor (floor = min_lr / lr)."""

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        done = (step - warmup) / (steps - warmup)
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * done))

    return factor


def test_clipping_and_cosine_schedule_equal_torch_and_resume_mid_schedule(tmp_path) -> None:
    """Clipping to a norm the gradients exceed and a cosine schedule with warmup train as clip_grad_norm_ and
    LambdaLR do (learning rates, norms before clipping, losses, weights; dropout on); a run resumed at step 3 of 5
    (mid-schedule) repeats the uninterrupted run's steps 3 and 4."""
    ck = tmp_path / "ck"
    config = TrainConfig(
        "zoo:gpt2",
        {"cpu": "100%"},
        steps=5,
        scale="tiny",
        lr=3e-3,
        clip_grad=0.2,
        lr_schedule="cosine",
        warmup=2,
        min_lr=3e-4,
        profile="model",
        method="sqrt",
        cache_dir=str(tmp_path),
        checkpoint_dir=str(ck),
        checkpoint_every=3,
    )
    whole = train(config)
    z = zoo.build("gpt2", scale="tiny")
    factor = cosine_factor(2, 5, 0.1)
    want = eager_train(
        z.model, gpt2_batches("tiny", 2), tasks.task_loss("gpt2"), 5, lr=3e-3, clip=0.2, lr_lambda=factor
    )
    assert [r.lr for r in whole.records] == pytest.approx(want["lr"], rel=1e-12)
    assert min(want["grad_norm"]) > 0.2  # every step was clipped
    assert [r.grad_norm for r in whole.records] == pytest.approx(want["grad_norm"], rel=1e-5)
    assert_close(whole.losses, want["loss"], rtol=1e-5, atol=1e-6)
    assert_same_weights(read_checkpoint(ck, 5)["model"], want["model"], rtol=1e-5, atol=1e-6)

    checkpoint_path(ck, 5).unlink()
    resumed = train(dataclasses.replace(config, resume=True))
    assert resumed.start_step == 3 and [r.lr for r in resumed.records] == [r.lr for r in whole.records[3:]]
    assert resumed.losses == whole.losses[3:]
    assert_same_weights(read_checkpoint(ck, 5)["model"], want["model"], rtol=1e-5, atol=1e-6)


def test_schedules_against_torch_schedulers() -> None:
    """Past the warmup, cosine is CosineAnnealingLR (eta_min = min_lr) and linear is LinearLR towards
    min_lr / lr, each over the steps after the warmup; the warmup is LinearLR from lr / warmup."""
    steps, warmup, lr, floor = 12, 3, 0.5, 0.05

    def torch_rates(after: type, **kwargs: float) -> list[float]:
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
        rise = torch.optim.lr_scheduler.LinearLR(opt, start_factor=1 / warmup, total_iters=warmup - 1)
        fall = after(opt, **kwargs)
        both = torch.optim.lr_scheduler.SequentialLR(opt, [rise, fall], milestones=[warmup])
        rates = []
        for _ in range(steps):
            rates.append(opt.param_groups[0]["lr"])
            opt.step()
            both.step()
        return rates

    cosine = torch_rates(torch.optim.lr_scheduler.CosineAnnealingLR, T_max=steps - warmup, eta_min=lr * floor)
    linear = torch_rates(
        torch.optim.lr_scheduler.LinearLR, start_factor=1.0, end_factor=floor, total_iters=steps - warmup
    )
    for name, want in (("cosine", cosine), ("linear", linear)):
        got = [Schedule(name, lr, warmup, lr * floor, steps).lr_at(s) for s in range(steps)]
        assert got == pytest.approx(want, rel=1e-7), name
    assert [Schedule("constant", lr, warmup).lr_at(s) for s in range(5)] == pytest.approx(
        [lr / 3, lr * 2 / 3, lr, lr, lr]
    )
