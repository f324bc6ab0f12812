"""Op outputs whose dtype depends on the device that computes them: the table, the graph pass that types a graph for
a device, and the adapter that runs such an op where the device's kernel makes (or reads) another dtype.

For half/bf16 inputs, `native_layer_norm` keeps its mean and rstd in float32 on CUDA (the accumulation type) but
in the input's dtype on the CPU (float32 there only beside float32 weights: ATen's mixed types), and each device's
`native_layer_norm_backward` reads them only in the dtype its own forward makes (measured on the H100 for bf16 and
fp16; group norm and fused RMS norm make the same dtypes on both). Batch norm follows the same rule: on the CPU its
statistics are float32 for a bf16 input beside float32 weights (measured; on CUDA not yet). Capture traces fake
tensors of the model's weights, whose kernels follow the model's device (and miss the CPU's mixed types), so a CPU
model captured for a GPU says what the CPU makes: `typed_for(graph, "cuda")` makes it say what the GPU makes.
`on_device` runs such an op on a device whose kernel disagrees with the graph (a CUDA-typed graph's layer norm on
the CPU, a CPU-typed graph file on a GPU). Another op of this kind is one line of DEVICE_TYPED.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any

import torch

from xsched.contracts.device_kernels import kernel_for
from xsched.contracts.graph import Graph, Op, Value

LOW_PRECISION = frozenset({"float16", "bfloat16"})
KERNEL_DEVICE_TYPES = ("cpu", "cuda")  # the device types whose kernels the table describes; others run as they are


def norm_stats(device_type: str, input_dtype: str, param_dtype: str | None) -> str:
    """The dtype a norm kernel on `device_type` keeps its statistics in, for an input of `input_dtype` and weights
    (the first one given) of `param_dtype`: CUDA's accumulation type (at::toAccumulateType: float32 for half and
    bf16); on the CPU the input's dtype, float32 where the weights are another dtype (ATen's mixed-type rule)."""
    if input_dtype not in LOW_PRECISION:
        return input_dtype
    if device_type == "cuda" or (param_dtype is not None and param_dtype != input_dtype):
        return "float32"
    return input_dtype


@dataclass(frozen=True)
class DeviceTyped:
    """An op whose kernels make (`outputs`: positions in its return) or read (`reads`: argument names) tensors in
    the dtype `rule(device type, dtype of argument `by`, dtype of the first of `params` given)`."""

    outputs: tuple[int, ...] = ()
    reads: tuple[str, ...] = ()
    by: str = "input"
    params: tuple[str, ...] = ("weight", "bias")
    rule: Callable[[str, str, str | None], str] = norm_stats


_BN_PARAMS = ("weight", "bias", "running_mean", "running_var")  # ATen's mixed-type check reads each of them
_BN = DeviceTyped(outputs=(1, 2), params=_BN_PARAMS)  # save_mean, save_invstd
DEVICE_TYPED: dict[str, DeviceTyped] = {
    "aten.native_layer_norm.default": DeviceTyped(outputs=(1, 2)),  # mean, rstd
    "aten.native_layer_norm_backward.default": DeviceTyped(reads=("mean", "rstd")),
    # a bf16 input beside float32 weights and statistics (CPU autocast leaves batch norm alone): float32 on the CPU
    # too, where the fake kernel says bf16 and the backward refuses bf16 statistics
    "aten._native_batch_norm_legit_functional.default": _BN,
    "aten._native_batch_norm_legit.default": _BN,
    "aten._native_batch_norm_legit_no_training.default": _BN,
    "aten.native_batch_norm.default": _BN,
    "aten.native_batch_norm_backward.default": DeviceTyped(
        reads=("save_mean", "save_invstd"), params=("weight", "running_mean", "running_var")
    ),
}


# ---- the graph pass ----
def typed_for(graph: Graph, device_type: str) -> Graph:
    """`graph` with each device-typed output in the dtype `device_type`'s kernel makes it (its nbytes scaled), so
    the graph counts the bytes that device's run holds; `graph` itself where nothing changes. An output some op
    outside the table reads keeps its dtype: that op's result would change with it (the adapter casts instead)."""
    if device_type not in KERNEL_DEVICE_TYPES:
        return graph
    readers = _readers(graph)
    retyped: dict[str, Value] = {}
    for op in graph.ops:
        entry = DEVICE_TYPED.get(op.target)
        if entry is None or not entry.outputs:
            continue
        want = kernel_dtype(graph, op, device_type)
        for vid in typed_outputs(graph, op):
            adapts = all(DEVICE_TYPED.get(graph.op[r].target, DeviceTyped()).reads for r in readers.get(vid, ()))
            if want is not None and graph.value[vid].dtype != want and adapts:
                retyped[vid] = retype(graph.value[vid], want)
    if not retyped:
        return graph
    return dataclasses.replace(graph, values=tuple(retyped.get(v.id, v) for v in graph.values))


def retype(v: Value, dtype: str) -> Value:
    """Value `v` holding `dtype` elements: the same shape and layout, its bytes scaled by the element sizes."""
    old, new = getattr(torch, v.dtype or "float32").itemsize, getattr(torch, dtype).itemsize
    return dataclasses.replace(v, dtype=dtype, nbytes=v.nbytes * new // old)


def _readers(graph: Graph) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for op in graph.ops:
        for vid in dict.fromkeys(op.inputs):
            out.setdefault(vid, []).append(op.id)
    return out


# ---- what a device's kernel makes and reads, against the graph ----
def kernel_dtype(graph: Graph, op: Op, device_type: str) -> str | None:
    """The dtype `device_type`'s kernel makes or reads `op`'s device-typed tensors in, from its arguments' graph
    dtypes; None for an op outside the table (or without the argument that decides)."""
    entry = DEVICE_TYPED.get(op.target)
    if entry is None:
        return None
    by = _arg_dtype(graph, op, entry.by)
    params = [d for d in (_arg_dtype(graph, op, p) for p in entry.params) if d is not None]
    return entry.rule(device_type, by, params[0] if params else None) if by else None


def agrees(graph: Graph, op: Op, device_type: str) -> bool:
    """Whether `device_type`'s kernel makes and reads `op`'s device-typed tensors in the graph's dtypes: it runs
    as it is (an `out=` call into tensors of the graph's dtypes, which refuses a cast, works too)."""
    entry = DEVICE_TYPED.get(op.target)
    if entry is None or device_type not in KERNEL_DEVICE_TYPES:
        return True
    want = kernel_dtype(graph, op, device_type)
    made = [graph.value[v].dtype for v in typed_outputs(graph, op)]
    return all(d == want for d in [*made, *(_arg_dtype(graph, op, r) for r in entry.reads)] if d is not None)


def typed_outputs(graph: Graph, op: Op) -> dict[str, int]:
    """`op`'s device-typed output values (with a dtype) -> their positions in its return."""
    entry = DEVICE_TYPED.get(op.target)
    if entry is None or not isinstance(op.call, Mapping):
        return {}
    paths = [tuple(p) for p in op.call.get("outs", ())]
    return {
        v: p[0] for v, p in zip(op.outputs, paths) if len(p) == 1 and p[0] in entry.outputs and graph.value[v].dtype
    }


def _arg_dtype(graph: Graph, op: Op, name: str) -> str | None:
    """The graph dtype of `op`'s tensor argument `name` (None: not given, or not a tensor)."""
    call = op.call if isinstance(op.call, Mapping) else {}
    names = arg_names(op.target)
    x = call.get("kwargs", {}).get(name)
    if x is None and name in names and names.index(name) < len(call.get("args", [])):
        x = call["args"][names.index(name)]
    return graph.value[x["ref"]].dtype if isinstance(x, Mapping) and "ref" in x else None


@cache
def arg_names(target: str) -> tuple[str, ...]:
    """The schema's argument names of an aten target "aten.name.overload"."""
    ns, name, overload = target.split(".")
    return tuple(a.name for a in getattr(getattr(getattr(torch.ops, ns), name), overload)._schema.arguments)


# ---- the adapter ----
def adapted(graph: Graph | None, op: Op, fn: Callable[..., Any], device_type: str) -> Callable[..., Any]:
    """`fn`, the callable of `op`, to run on a `device_type` device: itself where that device's kernel agrees with
    `graph` (no wrapper in the hot path), else `on_device` casting to the graph's dtypes; without a graph (an op
    profiled alone) the arguments its kernel reads are cast, its outputs left as made. An op without a kernel on
    that device type runs its stand-in (contracts/device_kernels.py) instead of `fn`."""
    fn = kernel_for(op.target, fn, device_type, op.id)
    if graph is None:
        return on_device(op.target, fn, device_type)
    if agrees(graph, op, device_type):
        return fn
    dtypes = {k: graph.value[v].dtype for v, k in typed_outputs(graph, op).items()}
    return on_device(op.target, fn, device_type, dtypes)  # type: ignore[arg-type]


def on_device(
    target: str, fn: Callable[..., Any], device_type: str, dtypes: Mapping[int, str] | None = None
) -> Callable[..., Any]:
    """`fn`, the callable of op `target`, as it runs on a `device_type` device: the arguments its kernel reads in
    its own dtype cast to it, and the return positions of `dtypes` (the graph's dtypes) cast to them where the
    kernel makes another. `fn` itself for any other op. On the CPU a CUDA-typed graph's statistics round-trip
    exactly (bf16 made, held as float32, read back as bf16); on CUDA a CPU-typed graph keeps the GPU's float32 mean
    and rstd as bf16, so its backward reads a rounded rstd (precision lost): CUDA targets are captured CUDA-typed
    (`typed_for`), and this path serves plans and graph files that are not."""
    entry = DEVICE_TYPED.get(target)
    if entry is None or device_type not in KERNEL_DEVICE_TYPES:
        return fn
    names = arg_names(target)
    reads = [names.index(r) for r in entry.reads]
    by, params = names.index(entry.by), [names.index(p) for p in entry.params]
    casts = {k: getattr(torch, d) for k, d in (dtypes or {}).items() if k in entry.outputs}
    if not reads and not casts:
        return fn

    def arg(args: Sequence[Any], kwargs: Mapping[str, Any], k: int) -> Any:
        return args[k] if k < len(args) else kwargs.get(names[k])

    def run(*args: Any, **kwargs: Any) -> Any:
        a, kw = list(args), dict(kwargs)
        if reads:
            given = [arg(a, kw, k) for k in params]
            param = next((_name(p.dtype) for p in given if isinstance(p, torch.Tensor)), None)
            want = getattr(torch, entry.rule(device_type, _name(arg(a, kw, by).dtype), param))
            for k in reads:
                t = arg(a, kw, k)
                if isinstance(t, torch.Tensor) and t.dtype != want:
                    if k < len(a):
                        a[k] = t.to(want)
                    else:
                        kw[names[k]] = t.to(want)
        result = fn(*a, **kw)
        if casts:
            result = tuple(
                r.to(casts[k]) if k in casts and isinstance(r, torch.Tensor) and r.dtype != casts[k] else r
                for k, r in enumerate(result)
            )
        return result

    return run


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
