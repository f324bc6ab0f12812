"""Dropout traced as a GPU runs it, whatever device the traced model is on. `F.dropout` is one aten op above the
dispatcher (`aten.dropout`, composite): on CUDA it runs the fused `native_dropout` (a bool mask, one kernel, the
mask drawn from CUDA's generator as the fused kernel draws it), on the CPU four ops (`empty_like`, `bernoulli`,
`div`, `mul`) that keep a float mask, four times the bytes. A graph captured from CPU tensors for a GPU (`xsched
train` builds and traces the model on the host) recorded the CPU's four: the GPU then ran four kernels where eager
runs one, held the float mask, and drew other masks than eager from the same seed. While `fused_dropout` is active,
training-mode dropout is traced as ATen's CUDA path takes it (`dropout` in aten/src/ATen/native/Dropout.cpp: fused
where 0 < p < 1 and the input is not empty; in-place dropout is not fused there either). On the CPU `native_dropout`
draws the same mask from the same generator state as the CPU's own dropout, and gives the same outputs, so a graph
typed for a GPU still runs as eager on logical CPU devices (in float32 bit for bit; in half precision its backward
scales the gradient by the unrounded 1 / (1 - p), the CPU's by that scale rounded to the dtype: tests/
test_fused_dropout.py)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

FUSED_DROPOUT_DEVICES = ("cuda",)  # device types whose dropout is ATen's fused kernel (is_fused_kernel_acceptable)


class _FusedDropout(TorchFunctionMode):
    """`F.dropout` and `torch.dropout` in training mode as `native_dropout`; in-place dropout is left as it is (ATen
    runs `dropout_` unfused on CUDA too)."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is F.dropout:
            x, p, train, inplace = _bind(args, kwargs, ("input", "p", "training", "inplace"), (0.5, True, False))
            if not inplace and _fused(x, p, train):
                return torch.native_dropout(x, p, True)[0]
        elif func is torch.dropout:
            x, p, train = _bind(args, kwargs, ("input", "p", "train"), ())
            if _fused(x, p, train):
                return torch.native_dropout(x, p, True)[0]
        return func(*args, **kwargs)


def _bind(args: tuple, kwargs: dict, names: tuple[str, ...], defaults: tuple) -> list[Any]:
    """The call's arguments by position, keywords and defaults (the last len(defaults) names have them)."""
    first_default = len(names) - len(defaults)
    return [
        args[k] if k < len(args) else kwargs[name] if name in kwargs else defaults[k - first_default]
        for k, name in enumerate(names)
    ]


def _fused(x: torch.Tensor, p: float, train: bool) -> bool:
    """ATen's test (`is_fused_kernel_acceptable`, the device aside): elsewhere dropout returns its input or masks
    all of it, the same on every device."""
    return bool(train) and 0 < p < 1 and x.numel() > 0


@contextlib.contextmanager
def fused_dropout(device_type: str) -> Iterator[None]:
    """While active, dropout traces as `device_type`'s kernels run it: fused on a GPU, unchanged elsewhere."""
    if device_type not in FUSED_DROPOUT_DEVICES:
        yield
        return
    with _FusedDropout():
        yield
