"""Helpers for the `xsched train` tests: the plain-PyTorch reference run, and launching the CLI as a subprocess."""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "train_mlp.py"


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


def eager_run(path: Path, batch: int, world: int, steps: int, lr: float = 1e-3) -> tuple[list[float], torch.nn.Module]:
    """Plain PyTorch, no xsched: the factory's model trained with AdamW on each step's combined batch (the rows all
    `world` ranks of `batch` rows see); returns the losses and the trained model."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    torch.manual_seed(0)
    model, _, loss_fn, batches = module.factory(batch=batch)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
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
