"""A wrapped model's state_dict and load_state_dict as PyTorch users expect them while its weights are views of
shared buffers (the host optimizer's buckets, pinned slabs): each saved tensor over storage of its own on the same
memory (no copy), so torch.save writes each weight's bytes once and safetensors and Hugging Face's save_pretrained
take the tensors as they take an eager model's; a load copies in place into those buffers, after the updates under
way, and the host optimizer's master weights follow it."""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn

from xsched.errors import XschedError
from xsched.execute.param_home import ListenerSlot

Region = tuple[torch.device, int, torch.dtype, tuple[int, ...], tuple[int, ...]]


def covers_part(t: torch.Tensor) -> bool:
    """Whether `t` spans only part of its storage (a view of a buffer other tensors share)."""
    if t.numel() == 0:
        return t.untyped_storage().nbytes() > 0
    extent = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    return t.storage_offset() > 0 or extent * t.element_size() < t.untyped_storage().nbytes()


def own_storage(t: torch.Tensor) -> torch.Tensor:
    """`t` over storage of its own: the same memory, no copy (through DLPack, which keeps the buffer alive as long
    as it is), or a copy of `t` alone where DLPack has no code for its dtype."""
    if t.numel() == 0:
        return torch.empty(t.shape, dtype=t.dtype, device=t.device)
    try:
        return torch.from_dlpack(t)
    except (BufferError, RuntimeError, TypeError):
        return t.clone()


class Regions:
    """For each state_dict call (its destination, held weakly), the tensor of its own given to each memory region,
    so that a weight two modules hold (tied) is one tensor in it, as in an eager model's state_dict."""

    def __init__(self) -> None:
        self._calls: dict[int, tuple[weakref.ref, dict[Region, torch.Tensor]]] = {}

    def of(self, state: dict[str, Any]) -> dict[Region, torch.Tensor]:
        key = id(state)
        held = self._calls.get(key)
        if held is not None and held[0]() is state:
            return held[1]
        try:
            ref = weakref.ref(state, lambda _, k=key: self._calls.pop(k, None))
        except TypeError:  # a plain dict passed as the destination: no record (tied weights then get one each)
            return {}
        self._calls[key] = (ref, {})
        return self._calls[key][1]


def give_own_storages(module: nn.Module, state: dict[str, Any], prefix: str, made: dict[Region, torch.Tensor]) -> None:
    """The module's own entries in `state` (under `prefix`) that span part of their storage, each over storage of
    its own; the same memory region gets the tensor `made` has for it."""
    for name in [*module._parameters, *module._buffers]:
        t = state.get(prefix + name)
        if not isinstance(t, torch.Tensor) or not covers_part(t):
            continue
        region = (t.device, t.data_ptr(), t.dtype, tuple(t.shape), t.stride())
        if region not in made:
            made[region] = own_storage(t)
        state[prefix + name] = made[region]


def _settle(slot: ListenerSlot) -> None:
    """Wait for the listener's updates under way (the host optimizer writes the weights on its own thread)."""
    listener = slot.listener
    if getattr(listener, "busy", None) is not None and listener.busy():
        listener.settle()


def install_state_hooks(model: nn.Module, slot: ListenerSlot) -> None:
    """On each module of `model` (so they run from any of its modules' state_dict or load_state_dict and from the
    wrapper's): a save waits for the updates under way and gives each shared-buffer tensor storage of its own (not
    with keep_vars: those are the live tensors); a load waits for them too, refuses assign=True (it would part the
    parameters from the buffers and the plan that hold them) and then hands the parameters it wrote to the listener
    (`weights_loaded`), whose master weights take them."""
    regions = Regions()
    keep_vars: dict[int, bool] = {}  # each module's call under way
    versions: dict[int, list[int]] = {}  # each module's parameters' versions before its load

    def before_save(module: nn.Module, prefix: str, keep: bool) -> None:
        _settle(slot)
        keep_vars[id(module)] = keep

    def after_save(module: nn.Module, state: dict[str, Any], prefix: str, metadata: Any) -> None:
        if not keep_vars.get(id(module)):
            give_own_storages(module, state, prefix, regions.of(state))

    def before_load(module: nn.Module, state: Any, prefix: str, metadata: dict, *rest: Any) -> None:
        if metadata.get("assign_to_params_buffers"):
            raise XschedError(
                "load_state_dict(assign=True) would replace the parameters that the wrapped model's plan and its "
                "optimizer's buffers hold: load without assign (it copies into them in place)",
                stage="execute",
            )
        _settle(slot)
        versions[id(module)] = [p._version for p in module._parameters.values() if p is not None]

    def after_load(module: nn.Module, incompatible: Any) -> None:
        loaded = getattr(slot.listener, "weights_loaded", None)
        params = [p for p in module._parameters.values() if p is not None]
        written = [p for p, v in zip(params, versions.pop(id(module), [])) if p._version != v]
        if loaded is not None and written:
            loaded(written)

    for m in model.modules():
        m.register_state_dict_pre_hook(before_save)
        m.register_state_dict_post_hook(after_save)
        m.register_load_state_dict_pre_hook(before_load)
        m.register_load_state_dict_post_hook(after_load)
