"""The aten ops each block of a module list runs in one forward on fake tensors, so that blocks which look alike
(class, parameters) but act differently (an extra op, another shape or constant, checkpointed or not) are found
before their graph is extrapolated from a few of them."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from xsched.capture.module_frames import compiler_tracing

_PLAIN = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)


def _saving_hooks() -> bool:
    """Whether saved-tensor hooks are active (activation checkpointing, offloading of saved tensors)."""
    return torch._C._autograd._top_saved_tensors_default_hooks(True) is not None


def _describe(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return ("T", tuple(x.shape), tuple(x.stride()), x.dtype, x.requires_grad)
    if isinstance(x, _PLAIN):
        return x
    return type(x).__name__


class _Recorder(TorchDispatchMode):
    """Every aten call made while one of `blocks` runs, under that block's position."""

    def __init__(self, blocks: nn.Module) -> None:
        super().__init__()
        self.position = {id(b): i for i, b in enumerate(blocks)}
        self.ops: list[list[tuple]] = [[] for _ in blocks]
        self.active: list[int] = []

    def enter(self, module: nn.Module, args: Any) -> None:
        if id(module) in self.position:
            self.active.append(self.position[id(module)])

    def leave(self, module: nn.Module, args: Any, out: Any) -> None:
        if id(module) in self.position and self.active:
            self.active.pop()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if self.active:
            leaves = tree_flatten((args, kwargs or {}))[0]
            call = (str(func), tuple(_describe(x) for x in leaves), torch.is_grad_enabled(), _saving_hooks())
            self.ops[self.active[-1]].append(call)
        return func(*args, **(kwargs or {}))


def block_ops(model: nn.Module, blocks: nn.Module, inputs: tuple, inference: bool) -> list[list[tuple]]:
    """Per block of `blocks` (a list inside `model`), the aten calls it made in `model(*inputs)` on fake tensors:
    op, arguments (tensor metadata, constants), grad mode and whether saved-tensor hooks were on."""
    recorder = _Recorder(blocks)
    params = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    hooks = [
        nn.modules.module.register_module_forward_pre_hook(recorder.enter),
        nn.modules.module.register_module_forward_hook(recorder.leave),
    ]
    try:
        with FakeTensorMode(allow_non_fake_inputs=False) as mode:
            state = {k: mode.from_tensor(t) for k, t in params.items()}
            args = tuple(mode.from_tensor(x) if isinstance(x, torch.Tensor) else x for x in inputs)
            with torch.no_grad() if inference else torch.enable_grad(), compiler_tracing(), recorder:
                torch.func.functional_call(model, state, args)
    finally:
        for h in hooks:
            h.remove()
    return recorder.ops


def first_unlike(ops: list[list[tuple]]) -> int | None:
    """The position of the first block whose calls differ from block 0's, else None."""
    return next((i for i, o in enumerate(ops) if o != ops[0]), None)
