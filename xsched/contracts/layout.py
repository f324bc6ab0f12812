"""The layout of a graph value (strides and storage offset, as eager PyTorch lays it out): defaults, checks, JSON."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Protocol

from xsched.errors import GraphError


class Laid(Protocol):
    """What a layout is read from: a graph `Value`'s id, shape, strides and storage offset."""

    id: str
    shape: tuple[int, ...] | None
    stride: tuple[int, ...] | None
    storage_offset: int


# An op may return a tensor that is not contiguous (SDPA's output is a transposed (batch, seq, heads, dim) buffer),
# and the view chains folded into its readers' refs (transpose, then view) only work on that layout. Files without
# these keys (contiguous values, graphs of older captures) load as contiguous.
LAYOUT_KEYS = ("stride", "storage_offset")


def contiguous_strides(shape: Iterable[int]) -> tuple[int, ...]:
    """Row-major strides of `shape` (as torch gives a new tensor)."""
    out: list[int] = []
    step = 1
    for s in reversed(tuple(shape)):
        out.append(step)
        step *= max(int(s), 1)
    return tuple(reversed(out))


def layout(v: Laid) -> tuple[tuple[int, ...], int]:
    """(strides, storage offset) of `v` as eager PyTorch makes it; contiguous when the graph records none."""
    return (v.stride if v.stride is not None else contiguous_strides(v.shape or ())), v.storage_offset


def storage_numel(shape: Iterable[int], stride: Iterable[int], offset: int = 0) -> int:
    """Elements of storage a tensor of this shape, strides and offset spans (0 for an empty tensor)."""
    shape = tuple(shape)
    if any(s == 0 for s in shape):
        return 0
    return offset + 1 + sum((s - 1) * st for s, st in zip(shape, stride))


def layout_to_dict(v: Laid) -> dict[str, Any]:
    d: dict[str, Any] = {}
    if v.stride is not None:
        d["stride"] = list(v.stride)
    if v.storage_offset:
        d["storage_offset"] = v.storage_offset
    return d


def layout_from_dict(d: Mapping[str, Any]) -> dict[str, Any]:
    stride = d.get("stride")
    return {
        "stride": tuple(int(s) for s in stride) if stride is not None else None,
        "storage_offset": int(d.get("storage_offset", 0)),
    }


def check_layout(v: Laid) -> None:
    if not isinstance(v.storage_offset, int) or v.storage_offset < 0:
        raise GraphError(f"storage_offset must be a non-negative integer, got {v.storage_offset!r}", value=v.id)
    if v.stride is None:
        return
    if v.shape is None:
        raise GraphError("a value with strides needs a shape", value=v.id)
    if len(v.stride) != len(v.shape) or any(not isinstance(s, int) or s < 0 for s in v.stride):
        raise GraphError(
            f"stride {list(v.stride)} must be one non-negative integer per dimension of shape {list(v.shape)}",
            value=v.id,
        )
