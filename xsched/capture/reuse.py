"""Capturing the same model on the same inputs once per scope: `xsched train` captures to plan, then `wrap` (and an
evaluating run's inference plan) capture the very same model again; within `captured_once()` the repeat returns the
first graph instead of tracing the model again (seconds per thousand ops on fake tensors). Likewise the fake
forward that finds the model's outputs (the loss's outputs, the capture's tangents, `wrap`'s output structure)."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import TreeSpec, tree_flatten

from xsched.contracts.graph import Graph

_SCOPE: ContextVar[dict[tuple, tuple[nn.Module, Any]] | None] = ContextVar("xsched_capture_scope", default=None)
_AUTOCAST_KINDS = ("cpu", "cuda")


@contextlib.contextmanager
def captured_once() -> Iterator[None]:
    """Within: a capture (or a fake forward, `fake_outputs`) whose key (`capture_key`) matches an earlier one in
    the scope returns that graph (those outputs). The
    caller promises not to change the model's code or Python state between the captures in the scope; what the
    key sees (parameters, buffers, inputs, mode, autocast, the options) may change, and then the model is traced."""
    token = _SCOPE.set({})
    try:
        yield
    finally:
        _SCOPE.reset(token)


def _tensor_key(t: torch.Tensor) -> tuple:
    return (tuple(t.shape), t.dtype, str(t.device), t.requires_grad, t.layout, tuple(t.stride()))


def _leaf_key(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return ("tensor", *_tensor_key(x))
    try:
        hash(x)
    except TypeError:
        return ("unhashable", id(x))  # equal only to the very same object
    return ("value", type(x).__name__, x)


def autocast_state() -> tuple:
    """Which device types' autocast is on, and to which dtype: a trace records the casts it makes."""
    return tuple(
        (k, torch.is_autocast_enabled(k), torch.get_autocast_dtype(k) if torch.is_autocast_enabled(k) else None)
        for k in _AUTOCAST_KINDS
    )


def capture_key(model: nn.Module, inputs: tuple, inference: bool, grad_outputs: Any, target: str = "") -> tuple:
    """What a capture depends on besides the model's code: the model object and its mode, every parameter's and
    buffer's name and metadata, the inputs' structure and metadata, grad and autocast state, and the options (the
    target device type among them: its kernels decide some ops, as dropout)."""
    leaves, spec = tree_flatten(inputs)
    return (
        id(model),
        tuple(m.training for m in model.modules()),
        tuple((k, *_tensor_key(p)) for k, p in model.named_parameters()),
        tuple((k, *_tensor_key(b)) for k, b in model.named_buffers()),
        str(spec),
        tuple(_leaf_key(x) for x in leaves),
        torch.is_grad_enabled(),
        autocast_state(),
        inference,
        _leaf_key(tuple(grad_outputs) if isinstance(grad_outputs, list) else grad_outputs),
        target,
    )


def reuse_or_capture(
    model: nn.Module,
    inputs: tuple,
    inference: bool,
    grad_outputs: Any,
    name: str,
    trace: Callable[[], Graph],
    target: str = "",
) -> Graph:
    """Outside a scope `trace()`; within, the scope's graph of the same `capture_key` (renamed `name`: the
    fingerprint leaves the name out), else `trace()`, kept for the scope's next capture of the same key. The scope
    holds the model, so its id in the key is not reused."""
    scope = _SCOPE.get()
    if scope is None:
        return trace()
    key = capture_key(model, inputs, inference, grad_outputs, target)
    if key in scope and scope[key][0] is model:
        graph = scope[key][1]
        return graph if graph.name == name else dataclasses.replace(graph, name=name)
    graph = trace()
    scope[key] = (model, graph)
    return graph


def scoped() -> bool:
    """Whether a `captured_once()` scope is open."""
    return _SCOPE.get() is not None


def remember(tag: str, model: nn.Module, inputs: tuple, value: Any) -> None:
    """Within a scope, keep `value` (what a fake forward found, `tag` says what) for `recall` with the same model
    and inputs, under the grad and autocast state in effect; outside a scope, nothing."""
    scope = _SCOPE.get()
    if scope is not None:
        scope[(tag, *capture_key(model, inputs, False, None))] = (model, value)


def recall(tag: str, model: nn.Module, inputs: tuple) -> Any | None:
    """What `remember` kept under `tag` for this model and inputs in the current state, else None."""
    scope = _SCOPE.get()
    key = (tag, *capture_key(model, inputs, False, None)) if scope is not None else None
    return scope[key][1] if scope is not None and key in scope and scope[key][0] is model else None


@dataclass(frozen=True)
class TensorMeta:
    """A forward output tensor as a fake forward made it."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    requires_grad: bool

    @property
    def differentiable(self) -> bool:
        return self.requires_grad and self.dtype.is_floating_point

    def leaf(self) -> torch.Tensor:
        """A new tensor like it (fake under a FakeTensorMode), a leaf that requires grad where it is differentiable."""
        t = torch.empty_strided(self.shape, self.stride, dtype=self.dtype, device=self.device)
        return t.requires_grad_(self.differentiable)


@dataclass(frozen=True)
class ForwardOutputs:
    """What model(*inputs) returns: its treespec and leaves, each tensor leaf as its TensorMeta."""

    spec: TreeSpec
    leaves: tuple[Any, ...]

    @property
    def tensors(self) -> list[TensorMeta]:
        return [x for x in self.leaves if isinstance(x, TensorMeta)]


def fake_outputs(model: nn.Module, inputs: tuple, forward: Callable[[], Any]) -> ForwardOutputs:
    """The outputs of `forward()`, the caller's fake forward of model(*inputs) under the grad mode and autocast in
    effect; within a scope, those of the scope's earlier fake forward of the same key, without running it."""
    found = recall("forward", model, inputs)
    if found is None:
        leaves, spec = tree_flatten(forward())
        found = ForwardOutputs(spec, tuple(_meta(x) if isinstance(x, torch.Tensor) else x for x in leaves))
        remember("forward", model, inputs, found)
    return found


def fake_state(
    mode: FakeTensorMode, named: Iterable[tuple[str, torch.Tensor]], inputs: tuple
) -> tuple[dict[str, torch.Tensor], tuple]:
    """A model's parameters and buffers (`named`) and its call's inputs as `mode`'s fake tensors, for a forward by
    torch.func.functional_call that computes and allocates nothing (the inputs that are not tensors as they are)."""
    state = {k: mode.from_tensor(t) for k, t in named}
    return state, tuple(mode.from_tensor(x) if isinstance(x, torch.Tensor) else x for x in inputs)


def _meta(t: torch.Tensor) -> TensorMeta:
    return TensorMeta(tuple(t.shape), tuple(t.stride()), t.dtype, t.device, t.requires_grad)
