"""Helpers for the `xsched train` tests: the plain-PyTorch reference run, launching the CLI as a subprocess, and
steps of a wrapped model under HostAdamW beside torch's AdamW."""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "train_mlp.py"


def teacher_mlp(layers: int, width: int) -> str:
    """The source of a `model.py:factory` training task: `layers` Linear+GELU pairs of `width`, a head of 8, and a
    fixed random teacher's tanh as the targets (each step's batch seeded by the step)."""
    return f"""
import torch
from torch import nn

def factory(batch=16):
    torch.manual_seed(0)
    layers = []
    for _ in range({layers}):
        layers += [nn.Linear({width}, {width}), nn.GELU()]
    model = nn.Sequential(*layers, nn.Linear({width}, 8))
    teacher = torch.randn({width}, 8, generator=torch.Generator().manual_seed(1))

    def batches(step, rank, world):
        gen = torch.Generator().manual_seed(1000 + step)
        x = torch.randn(world * batch, {width}, generator=gen)
        rows = slice(rank * batch, (rank + 1) * batch)
        return x[rows].clone(), torch.tanh(x @ teacher)[rows].clone()

    return model, batches(0, 0, 1), nn.functional.mse_loss, batches
"""


def child_env() -> dict[str, str]:
    """This worktree's xsched first, one thread per process (2 shared cores; also the same numerics every run)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["OMP_NUM_THREADS"] = "1"
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "xsched.cli", "train", *args]


def events(stdout: str) -> list[dict]:
    """Every line of a --json run's stdout, parsed (each must be one JSON object)."""
    return [json.loads(line) for line in stdout.splitlines() if line.strip()]


def step_losses(evs: list[dict]) -> dict[int, float]:
    return {e["step"]: e["loss"] for e in evs if e["event"] == "step"}


def weight_decays(model: torch.nn.Module, weight_decay: float = 0.01) -> dict[str, float]:
    """Each parameter's weight decay as `xsched train` sets it: on the weights (2+ dimensions), none on biases and
    norms (HostAdamW takes it by name)."""
    return {n: weight_decay if p.dim() >= 2 else 0.0 for n, p in model.named_parameters()}


def adamw(
    model: torch.nn.Module, lr: float = 1e-3, weight_decay: float = 0.01, fused: bool | None = None
) -> torch.optim.AdamW:
    """AdamW as `xsched train` sets it up: weight decay on the weights (2+ dimensions), none on biases and norms;
    `fused`: torch's fused step (what HostAdamW runs per bucket)."""
    params = list(model.parameters())
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=lr, fused=fused)


def eager_run(path: Path, batch: int, world: int, steps: int, lr: float = 1e-3) -> tuple[list[float], torch.nn.Module]:
    """Plain PyTorch, no xsched: the factory's model trained with AdamW on each step's combined batch (the rows all
    `world` ranks of `batch` rows see); returns the losses and the trained model."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    torch.manual_seed(0)
    model, _, loss_fn, batches = module.factory(batch=batch)
    opt = adamw(model, lr)
    losses = []
    for step in range(steps):
        parts = [batches(step, r, world) for r in range(world)]
        x, y = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
        loss = loss_fn(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, model


def eager_train(
    model: torch.nn.Module,
    batch_of: Callable[[int], tuple[tuple, Any]],
    loss_fn: Callable[[Any, Any], torch.Tensor],
    steps: int,
    *,
    lr: float = 1e-3,
    precision: str = "fp32",
    clip: float | None = None,
    lr_lambda: Callable[[int], float] | None = None,
    seed: int = 0,
    after_step: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """Plain PyTorch, as people train: AdamW (adamw() above), torch.autocast and torch.amp.GradScaler for
    bf16/fp16, clip_grad_norm_, a LambdaLR schedule. The training draws (dropout) are seeded with `seed` first, as
    `xsched train` seeds them after building the model. Returns the losses, learning rates, gradient norms (before
    clipping), loss scales (fp16) and the model; `after_step(step)` runs after each step (an evaluation)."""
    opt = adamw(model, lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda) if lr_lambda is not None else None
    scaler = torch.amp.GradScaler("cpu", enabled=precision == "fp16")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    torch.manual_seed(seed)
    out: dict[str, Any] = {"loss": [], "lr": [], "grad_norm": [], "loss_scale": [], "model": model}
    for step in range(steps):
        inputs, targets = batch_of(step)
        with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
            loss = loss_fn(model(*inputs), targets)
        opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip is not None else float("inf"))
        out["lr"].append(opt.param_groups[0]["lr"])
        scaler.step(opt)
        scaler.update()
        if sched is not None:
            sched.step()
        out["loss"].append(loss.item())
        out["grad_norm"].append(norm.item())
        out["loss_scale"].append(scaler.get_scale() if scaler.is_enabled() else None)
        if after_step is not None:
            after_step(step)
    return out


def assert_same_weights(state: dict[str, torch.Tensor], model: torch.nn.Module, **tolerance: float) -> None:
    """A checkpoint's (or module's) state dict against `model`'s, name by name."""
    from torch.testing import assert_close

    for name, p in model.state_dict().items():
        assert_close(state[name], p, **tolerance, msg=lambda m, n=name: f"{n}: {m}")


def steps_beside_adamw(
    w, host, ref: torch.nn.Module, opt: torch.optim.Optimizer, xs: list[torch.Tensor]
) -> list[tuple[float, float]]:
    """Per input, one step of the wrapped model `w` with `host` (a HostAdamW it tells) and one of `ref` with torch's
    `opt`, each on the sum of its squared outputs (lr 1e-2); then `w` stops telling `host`, which is closed. Per
    step: the total gradient norm `host` took, and that of `ref`'s gradients."""
    norms = []
    try:
        for x in xs:
            host.begin(True, True, 1e-2)
            w(x).square().sum().backward()
            host.end_backward()
            took = host.grad_norm()
            host.settle()
            opt.zero_grad()
            ref(x).square().sum().backward()
            want = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in ref.parameters()])).item()
            norms.append((took, want))
            opt.step()
    finally:
        w.listen(None)
        host.close()
    return norms


def assert_offloaded_mlp_trains_as_fused_adamw(
    prepare: Callable[[Any], None] = lambda w: None, device: str = "cpu:0", home: str = "cpu:1"
) -> Any:
    """An MLP wrapped on `device` with its parameters on the store `home` (`offload` plan) and HostAdamW listening,
    `prepare(w)` before its first run, two steps beside its twin on `device` under torch's fused AdamW on eager
    gradients: every gradient copied home straight into HostAdamW's buffer, both steps, the total gradient norm it
    took (on `device`, where the gradient was made) and the parameters equal; the wrapped module."""
    from torch import nn
    from torch.testing import assert_close

    from xsched.execute.wrap import wrap
    from xsched.train.host_adamw import HostAdamW

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 4))
    ref = nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 4))
    ref.load_state_dict(model.state_dict())
    ref.to(device)
    xs = [torch.randn(8, 32, device=device) for _ in range(2)]
    w = wrap(model, (xs[0],), {device: "100%"}, store=home, method="offload", profile="model", param_home=home)
    prepare(w)
    named = dict(model.named_parameters())
    host = HostAdamW([(n, named[n]) for n in w.release_order], dict.fromkeys(named, 0.0), lr=1e-2)
    w.listen(host)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.0, fused=True)
    for took, want in steps_beside_adamw(w, host, ref, opt, xs):
        assert took == pytest.approx(want, rel=1e-5)
    assert host.direct == 2 * len(named)  # every gradient, both steps
    for p, q in zip(model.parameters(), ref.parameters()):
        assert_close(p.detach(), q.detach().to(p.device), rtol=1e-5, atol=1e-6)
    return w
