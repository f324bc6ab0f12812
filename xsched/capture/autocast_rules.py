"""CPU autocast that records another device's casts: capture runs on the CPU, the plan runs where its graph goes.

`torch.autocast("cpu")` and `torch.autocast("cuda")` cast different ops. Where the CPU has a rule that CUDA has not
(`cross_entropy_loss`, `cat`, `stack`, pooling in 3-D, linear algebra, FFTs), a graph captured for a GPU would
compute what the GPU's eager run does not: under CPU autocast `F.cross_entropy` casts bf16 logits to fp32 before
its log_softmax, and its backward holds three fp32 logits-sized tensors at once; under CUDA autocast the log_softmax
runs in bf16 and only nll_loss's input is cast (two fp32 and one bf16). `device_rules("cuda")` makes CPU autocast
leave those ops alone, as CUDA's does, for as long as it is active: each is dispatched on to its own decomposition,
whose inner ops autocast then sees as it would on the GPU. The op lists come from the dispatcher, so they follow the
installed torch; the CPU's lower-precision rules among them (KEEP) stay. Rules CUDA has and the CPU lacks (CUDA runs
softmax and layer_norm in fp32) are not added: there such a graph holds less than the GPU's eager run, not more.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import warnings
from collections.abc import Iterator

import torch

_KEYS = {"cpu": "AutocastCPU", "cuda": "AutocastCUDA"}
# CPU rules that cast to the lower precision, kept: CUDA reaches the same precision through rules on the inner ops
# (convolution, addmm, the attention's matmuls) that the CPU lacks, so dropping these would compute them in fp32
KEEP = frozenset(
    {"conv1d.padding", "conv2d.padding", "conv3d.padding", "_addmm_activation", "_native_multi_head_attention"}
    | {"mkldnn_rnn_layer"}
)
_lock = threading.Lock()
_active: dict[str, tuple[int, torch.library.Library]] = {}  # device type -> (nesting depth, its registrations)


@functools.cache  # the dispatcher's autocast registrations are made when torch loads
def cpu_only_rules(device_type: str) -> tuple[str, ...]:
    """The aten ops (overload names) CPU autocast casts to fp32 or promotes and `device_type`'s autocast does not
    cast (those in KEEP aside)."""
    if device_type not in _KEYS:
        raise ValueError(f"autocast rules of {device_type!r}: one of {sorted(_KEYS)}")
    names = [n for n in torch._C._dispatch_get_all_op_names() if n.startswith("aten::")]
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    ops = (n[len("aten::") :] for n in names if has(n, _KEYS["cpu"]) and not has(n, _KEYS[device_type]))
    return tuple(sorted(op for op in ops if op not in KEEP))


@contextlib.contextmanager
def device_rules(device_type: str) -> Iterator[None]:
    """While active, CPU autocast casts no op that `device_type`'s autocast leaves alone (nothing for "cpu").
    Process-wide (the dispatcher's table), nestable; the CPU's own rules come back when the outermost one exits."""
    if device_type == "cpu":
        yield
        return
    _enter(device_type)
    try:
        yield
    finally:
        _exit(device_type)


def _enter(device_type: str) -> None:
    with _lock:
        depth, lib = _active.get(device_type, (0, None))  # type: ignore[arg-type]
        if lib is None:
            lib = torch.library.Library("aten", "IMPL")
            with warnings.catch_warnings():  # each override says it replaces the CPU's rule: that is its purpose
                warnings.simplefilter("ignore")
                for op in cpu_only_rules(device_type):
                    lib.impl(op, torch.library.fallthrough_kernel, _KEYS["cpu"])
        _active[device_type] = (depth + 1, lib)


def _exit(device_type: str) -> None:
    with _lock:
        depth, lib = _active[device_type]
        if depth > 1:
            _active[device_type] = (depth - 1, lib)
            return
        del _active[device_type]
        lib._destroy()  # the dispatcher restores the CPU's rules it had before
