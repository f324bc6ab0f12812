"""The aten ops each block of a module list runs in one forward on fake tensors, so that blocks which look alike
(class, parameters) but act differently (an extra op, another shape or constant, checkpointed or not) are found
before their graph is extrapolated from a few of them."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from xsched.capture.module_frames import compiler_tracing
from xsched.capture.reuse import fake_state

_PLAIN = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)


def _saving_hooks() -> bool:
    """Whether saved-tensor hooks are active (activation checkpointing, offloading of saved tensors)."""
    return torch._C._autograd._top_saved_tensors_default_hooks(True) is not None


def _describe(x: Any) -> Any:
    """An argument as it shapes the trace: a tensor's metadata, a constant itself, a list item by item."""
    if isinstance(x, torch.Tensor):
        return (x.shape, x.stride(), x.dtype, x.requires_grad)
    if isinstance(x, (list, tuple)):
        return tuple(_describe(y) for y in x)
    if isinstance(x, _PLAIN):
        return x
    return type(x).__name__


class _Recorder(TorchDispatchMode):
    """Every aten call made while one of `blocks` runs, under that block's position; and those made between two
    blocks (by the model around them), under the position of the block they follow."""

    def __init__(self, blocks: nn.Module) -> None:
        super().__init__()
        self.position = {id(b): i for i, b in enumerate(blocks)}
        self.ops: list[list[tuple]] = [[] for _ in blocks]
        self.between: list[list[tuple]] = [[] for _ in blocks]
        self.active: list[int] = []
        self.last = -1  # the block that ran last

    def enter(self, module: nn.Module, args: Any) -> None:
        if id(module) in self.position:
            self.active.append(self.position[id(module)])

    def leave(self, module: nn.Module, args: Any, out: Any) -> None:
        if id(module) in self.position and self.active:
            self.last = self.active.pop()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if (self.active or self.last >= 0) and func.namespace != "prim":  # prim: metadata queries (prim.device)
            call = (func, _describe(args), _describe(tuple((kwargs or {}).items())), torch.is_grad_enabled())
            where = self.ops[self.active[-1]] if self.active else self.between[self.last]
            where.append((*call, _saving_hooks()))
        return func(*args, **(kwargs or {}))

    def calls(self) -> list[tuple[list, list]]:
        """Per block, its calls and those before the next block (none after the last: the model's tail)."""
        return list(zip(self.ops, self.between[:-1] + [[]]))

    def saw_any(self) -> bool:
        return any(self.ops)


@contextlib.contextmanager
def recording(blocks: nn.Module) -> Iterator[_Recorder]:
    """Within: the calls of each block of `blocks` are recorded. Enter it inside the FakeTensorMode, so that it sees
    the calls before the fake mode does."""
    recorder = _Recorder(blocks)
    hooks = [
        nn.modules.module.register_module_forward_pre_hook(recorder.enter),
        nn.modules.module.register_module_forward_hook(recorder.leave),
    ]
    try:
        with recorder:
            yield recorder
    finally:
        for h in hooks:
            h.remove()


def block_ops(model: nn.Module, blocks: nn.Module, inputs: tuple, inference: bool) -> list[tuple[list, list]]:
    """Per block of `blocks` (a list inside `model`), the aten calls it made in `model(*inputs)` on fake tensors
    (op, arguments: tensor metadata, constants; grad mode, whether saved-tensor hooks were on), and after each but
    the last, those made before the next block ran."""
    params = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    with FakeTensorMode(allow_non_fake_inputs=False) as mode:
        state, args = fake_state(mode, params.items(), inputs)
        with torch.no_grad() if inference else torch.enable_grad(), compiler_tracing(), recording(blocks) as seen:
            torch.func.functional_call(model, state, args)
    return seen.calls()


def first_unlike(ops: list[tuple[list, list]]) -> int | None:
    """The position of the first block whose calls (or those between it and the next) differ from block 1's, else
    None. Block 0 may differ (its input is the model's, which may not need a gradient): every cut holds it as it is."""
    last = len(ops) - 1
    return next(
        (i for i in range(1, last + 1) if ops[i][0] != ops[1][0] or (i < last and ops[i][1] != ops[1][1])), None
    )
