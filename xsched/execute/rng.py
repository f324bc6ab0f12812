"""Random-number generator state per torch device: what replaying a random op's first run needs."""

from __future__ import annotations

import torch


def get_rng(device: torch.device) -> torch.Tensor:
    """The generator state `device` draws from now (its GPU's generator, or the CPU's)."""
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def set_rng(device: torch.device, state: torch.Tensor) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)
