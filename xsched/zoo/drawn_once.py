"""A large zoo model built on the CPU with its weights drawn once: on the meta device, torch's own init's draws skipped
(skip_draws), then the zoo's init; the plain build's weights and generator state, for about half its draws."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch
from torch import nn

from xsched.zoo import skip_draws

Model = TypeVar("Model", bound=nn.Module)


def built(build: Callable[[], Model], torch_draws: int, init: Callable[[Model], None]) -> Model:
    """build() on the current default device; on the CPU in float32, where torch's own init makes `torch_draws` >=
    JUMP_MIN draws, the same model with its weights drawn once (built_once). Small models are built plainly: meta's
    first use imports about 2 s of torch, and elsewhere (meta, another device) the draws cost nothing here or come
    from that device's own generator."""
    on_cpu = torch.get_default_device().type == "cpu" and torch.get_default_dtype() == torch.float32
    if on_cpu and torch_draws >= skip_draws.JUMP_MIN:
        return built_once(build, torch_draws, init)
    return build()


def built_once(build: Callable[[], Model], torch_draws: int, init: Callable[[Model], None]) -> Model:
    """build()'s model with the same weights, drawn once: built on the meta device (neither torch's init nor the
    zoo's draws anything there), given CPU memory with its ties kept, the global generator moved past the
    `torch_draws` 32-bit draws torch's init makes in build() on the CPU (a jump ahead for many), then `init`: what
    build() sets after those draws (values it sets without drawing, such as norms' ones and buffers, and the zoo's
    init, drawn in build()'s order)."""
    with torch.device("meta"):
        model = build()
    materialized(model, "cpu")
    skip_draws.skip_draws(torch_draws)
    init(model)
    return model


def materialized(model: nn.Module, device: torch.device | str) -> nn.Module:
    """`model` (built on the meta device) given uninitialised memory on `device` in place, its tied parameters
    tied again: to_empty gives each module its own tensor."""
    first: dict[int, str] = {}
    ties = []
    for qual, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            ties.append((qual, first[id(p)]))
        else:
            first[id(p)] = qual
    model.to_empty(device=device)
    for qual, shared in ties:
        owner, _, attr = qual.rpartition(".")
        setattr(model.get_submodule(owner), attr, model.get_parameter(shared))
    return model
