"""Training checkpoints: model, optimizer, step, every rank's RNG states and the data position in one file per saved
step (`step-00000040.pt`), written atomically (temp file, fsync, rename) so a killed run leaves the previous one
whole; the newest two are kept, and resuming reads the newest one that loads."""

from __future__ import annotations

import contextlib
import random
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from xsched.errors import XschedError
from xsched.files import atomic_write

FORMAT = "xsched.train.checkpoint/1"
KEEP = 2  # the newest file and one before it, in case the newest cannot be read
_NAME = re.compile(r"^step-(\d{8,})\.pt$")


def checkpoint_path(directory: str | Path, step: int) -> Path:
    return Path(directory) / f"step-{step:08d}.pt"


def saved_steps(directory: str | Path) -> list[int]:
    """Steps with a checkpoint file in `directory`, newest first (temp files of an interrupted save are not)."""
    d = Path(directory)
    if not d.is_dir():
        return []
    return sorted((int(m.group(1)) for p in d.iterdir() if (m := _NAME.match(p.name))), reverse=True)


def save_checkpoint(directory: str | Path, step: int, state: dict[str, Any]) -> Path:
    """Save `state` as the checkpoint after `step` steps, then drop all but the newest KEEP (and the temp files
    of an interrupted save)."""
    path = atomic_write(checkpoint_path(directory, step), lambda f: torch.save({"format": FORMAT, **state}, f))
    leftovers = list(Path(directory).glob(".step-*.tmp"))  # from a writer killed mid-save (one writer: rank 0)
    for old in [checkpoint_path(directory, s) for s in saved_steps(directory)[KEEP:]] + leftovers:
        with contextlib.suppress(OSError):
            old.unlink()
    return path


def read_checkpoint(directory: str | Path, step: int) -> dict[str, Any]:
    """The checkpoint after `step` steps; an unreadable or foreign file is an XschedError naming it."""
    path = checkpoint_path(directory, step)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # truncated, not a torch file, or pickled objects weights_only refuses
        raise XschedError(f"cannot read checkpoint {path}: {type(e).__name__}: {str(e)[:200]}", stage="train") from e
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise XschedError(f"{path} is not an xsched train checkpoint ({FORMAT})", stage="train")
    return state


def newest_checkpoint(directory: str | Path, notice: Callable[[str], None]) -> tuple[int, dict[str, Any]]:
    """The newest checkpoint in `directory` that reads; each unreadable newer one is one notice. No directory, or
    no readable checkpoint in it, is an XschedError."""
    if not Path(directory).is_dir():
        raise XschedError(f"--resume: checkpoint directory {directory} does not exist", stage="train")
    steps = saved_steps(directory)
    if not steps:
        raise XschedError(f"--resume: no checkpoint (step-*.pt) in {directory}", stage="train")
    for step in steps:
        try:
            return step, read_checkpoint(directory, step)
        except XschedError as e:
            notice(f"{e.detail}; trying an older checkpoint")
    raise XschedError(f"--resume: no readable checkpoint in {directory}", stage="train")


def rng_state() -> dict[str, Any]:
    """This process's RNG states: torch's CPU generator, every CUDA generator, Python's `random`."""
    out: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state_all()
    return out


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(_as_tuple(state["python"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _as_tuple(x: Any) -> Any:
    """random.setstate wants the nested tuples getstate gave; a checkpoint may hand them back as lists."""
    return tuple(_as_tuple(v) for v in x) if isinstance(x, (list, tuple)) else x
