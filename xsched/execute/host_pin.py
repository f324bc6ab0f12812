"""Host memory pinned once: the one helper every pin of host memory goes through, and a wrapped module's parameters
and buffers moved to their homes, pinned beside a GPU in the memory they end in (an optimizer's buffers, or their
own) at the first run."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
from torch import nn

from xsched.execute.reference import torch_device


def pins_host(devices: Iterable[torch.device]) -> bool:
    """Whether host tensors beside these devices are pinned: a GPU among them (and a build of torch with CUDA),
    so that the plan's copies between the host and the GPU run asynchronously."""
    return any(d.type == "cuda" for d in devices) and torch.cuda.is_available()


def pinned_empty(shape: torch.Size | tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A new uninitialized pinned host tensor: every pinned host allocation of a weight's home goes through here
    (tests count the bytes by replacing it; the CPU build of torch cannot pin)."""
    return torch.empty(shape, dtype=dtype, device="cpu", pin_memory=True)


def pin_host(t: torch.Tensor) -> torch.Tensor:
    """A pinned copy of the host tensor `t`, laid out as torch.empty_like lays it out (one allocation and one copy
    of its bytes)."""
    layout = torch.empty_like(t, device="meta")  # its strides, without allocating
    out = pinned_empty((t.numel(),), t.dtype).as_strided(t.shape, layout.stride())
    out.copy_(t)
    return out


def move_to_homes(module: nn.Module, home_of: Mapping[str, str], dev: Mapping[str, torch.device]) -> None:
    """Each parameter and buffer named in `home_of` onto its home's torch device (the others stay where they are),
    so that gradients land where autograd expects them. Nothing is pinned here: see `pin_unpinned`."""
    with torch.no_grad():
        for name, t in [*module.named_parameters(), *module.named_buffers()]:
            to = torch_device(home_of[name], dev) if name in home_of else t.device
            if t.device != to:
                t.data = t.data.to(to)


def pin_unpinned(module: nn.Module) -> int:
    """Pin the host parameters and buffers that nothing pinned yet, each into memory of its own; the bytes pinned.
    Run once, at the first run: an optimizer built before it (train.host_buckets) has packed the parameters it
    owns into its own pinned buffers, which they are views of, and those are not pinned again."""
    pinned = 0
    with torch.no_grad():
        for t in [*module.parameters(), *module.buffers()]:
            if t.device.type == "cpu" and not t.is_pinned():
                t.data = pin_host(t.data)
                pinned += t.numel() * t.element_size()
    return pinned
