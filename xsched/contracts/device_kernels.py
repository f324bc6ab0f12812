"""Ops whose kernels exist only on some device types, and what runs in their place elsewhere: the table, and the
hook `device_dtypes.adapted` calls so that every op-calling path (run_op, programs, compiled regions, segments,
profiling) runs the stand-in on a device without the kernel and the kernel itself where it exists.

A model captured on the CPU records the CPU's fused attention (`F.scaled_dot_product_attention` in Hugging Face
models and the zoo), which has no CUDA kernel: `xsched train --param-home cpu` captures a CPU-resident model for a
GPU, and `xsched run` may run a CPU-captured graph file on one. Its stand-in is contracts/neutral_attention.py.
Another op of this kind is one entry of DEVICE_KERNELS.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from xsched.contracts.neutral_attention import attention_backward, attention_forward, transient_bytes
from xsched.errors import XschedError

SDPA_CPU = "aten._scaled_dot_product_flash_attention_for_cpu.default"
SDPA_CPU_BACKWARD = "aten._scaled_dot_product_flash_attention_for_cpu_backward.default"


@dataclass(frozen=True)
class DeviceKernel:
    """An op with kernels on `device_types` only; `neutral` computes the same on any device, for the arguments
    it accepts; `dropout` names its dropout argument (at this position in the schema), which must be 0 off
    those devices: no stand-in draws the kernel's random mask. (Torch 2.13's CPU attention kernel refuses
    dropout itself, and a CPU capture with dropout takes the math path, so only a graph from elsewhere asks.)
    `workspace(*args, **kwargs)` bounds what the stand-in allocates beside its inputs and outputs, for cost models
    that cannot measure it."""

    device_types: tuple[str, ...]
    neutral: Callable[..., Any]
    dropout: tuple[str, int] | None = None
    workspace: Callable[..., int] | None = None  # the stand-in's transient bytes, from the op's arguments


# "meta" has the shape kernel (capture's fake tensors run it), so the stand-in is not needed there
def _forward_workspace(query: Any, key: Any, *_: Any, **__: Any) -> int:
    return transient_bytes(tuple(query.shape), tuple(key.shape), query.dtype, backward=False)


def _backward_workspace(grad_out: Any, query: Any, key: Any, *_: Any, **__: Any) -> int:
    return transient_bytes(tuple(query.shape), tuple(key.shape), query.dtype, backward=True)


DEVICE_KERNELS: dict[str, DeviceKernel] = {
    SDPA_CPU: DeviceKernel(("cpu", "meta"), attention_forward, ("dropout_p", 3), _forward_workspace),
    SDPA_CPU_BACKWARD: DeviceKernel(("cpu", "meta"), attention_backward, ("dropout_p", 6), _backward_workspace),
}


def has_kernel(target: str, device_type: str) -> bool:
    """Whether `device_type` has op `target`'s own kernel (every op outside the table has it everywhere)."""
    entry = DEVICE_KERNELS.get(target)
    return entry is None or device_type in entry.device_types


def kernel_for(target: str, fn: Callable[..., Any], device_type: str, op_id: str | None = None) -> Callable[..., Any]:
    """`fn`, the callable of op `target`, where `device_type` has its kernel; elsewhere the table's stand-in,
    refusing a nonzero dropout in one line naming the stage, the op (`op_id`) and the device."""
    if has_kernel(target, device_type):
        return fn
    entry = DEVICE_KERNELS[target]
    if entry.dropout is None:
        return entry.neutral
    name, position = entry.dropout
    neutral = entry.neutral

    def run(*args: Any, **kwargs: Any) -> Any:
        p = _arg(args, kwargs, name, position)
        if p:
            device = next((str(a.device) for a in args if hasattr(a, "device")), device_type)
            raise XschedError(
                f"{target} with {name}={p} has no kernel on {device_type}, and a stand-in's dropout could not draw "
                "the mask a kernel draws: capture the model on the device it runs on, or set its attention dropout "
                "to 0 (Hugging Face Llama, Qwen and Mistral default to 0)",
                stage="execute",
                op=op_id,
                device=device,
            )
        return neutral(*args, **kwargs)

    return run


def _arg(args: Sequence[Any], kwargs: Mapping[str, Any], name: str, position: int) -> Any:
    return args[position] if position < len(args) else kwargs.get(name, 0.0)


def stand_in_workspace(target: str, device_type: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> int:
    """The bytes op `target`'s stand-in allocates beside its inputs and outputs on a `device_type` device without
    its kernel (an upper bound from its arguments' shapes: meta tensors do), for a cost model that cannot measure
    it (a simulated GPU); 0 where the device has the kernel or the entry gives no bound."""
    entry = DEVICE_KERNELS.get(target)
    if entry is None or entry.workspace is None or has_kernel(target, device_type):
        return 0
    return int(entry.workspace(*args, **kwargs))
