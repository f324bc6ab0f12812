"""The executable op encoding (Op.call): JSON-able args with value refs and folded view chains, and running one op.

An op's `call` is `{"args": [...], "kwargs": {...}, "outs": [[0], [1]]}`. Tensor arguments are refs
`{"ref": value_id, "view": [[view_target, [args...]], ...]}`: the base value with the chain of view ops
(view, t, expand, getitem of a split, ...) that capture folded away, applied in order. Other leaves:
numbers, bools, strings, None, lists, `{"dtype": "float32"}`, `{"device": "cpu"}` (rewritten to the run
device), `{"layout": ..}`, `{"memory_format": ..}`, `{"float": "inf"}` (non-finite floats, which JSON lacks)
and small constants `{"tensor": nested list, "dtype": ..}`. `outs[i]` is the index path of output value i
inside the op's return.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from functools import cache
from typing import Any

import torch

from xsched.contracts.device_dtypes import adapted
from xsched.contracts.graph import Graph, Op, Value
from xsched.contracts.layout import layout, storage_numel
from xsched.errors import CaptureError, XschedError

MAX_INLINE_NUMEL = 64  # larger constant tensors belong in the graph as inputs, not in an op's JSON

Ref = dict[str, Any]


# ---- targets ----
# Functionalization turns eager's `empty_like(x).bernoulli_(p)` (dropout) into `bernoulli.p(x, p)`, whose
# kernel allocates a contiguous result: for a non-contiguous x it draws the same numbers in a different
# element order than eager. Running these as the in-place op on `empty_like(x)` (x's strides) is the
# same function and reproduces eager bit for bit.
_RANDOM_INPLACE = {
    "aten.bernoulli.p": "aten.bernoulli_.float",
    "aten.bernoulli.Tensor": "aten.bernoulli_.Tensor",
    "aten.uniform.default": "aten.uniform_.default",
    "aten.normal_functional.default": "aten.normal_.default",
    "aten.exponential.default": "aten.exponential_.default",
    "aten.cauchy.default": "aten.cauchy_.default",
    "aten.geometric.default": "aten.geometric_.default",
    "aten.log_normal.default": "aten.log_normal_.default",
    "aten.random.default": "aten.random_.default",
    "aten.random.from": "aten.random_.from",
    "aten.random.to": "aten.random_.to",
}


class _FillFresh:
    """A functional random op run as its in-place twin on a fresh tensor laid out like its input."""

    def __init__(self, functional: torch._ops.OpOverload, inplace: Callable[..., Any]) -> None:
        self.functional, self.inplace = functional, inplace
        self.tags, self._schema = functional.tags, functional._schema

    def __call__(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.inplace(torch.empty_like(x), *args, **kwargs)


@cache
def resolve(target: str) -> Callable[..., Any]:
    """Target name -> callable: "aten.convolution.default" -> torch.ops.aten.convolution.default, "getitem" -> x[i]."""
    if target == "getitem":
        return lambda x, i: x[i]
    parts = target.split(".")
    if len(parts) != 3:
        raise XschedError(f"op target {target!r} is not of the form namespace.name.overload", stage="execute")
    try:
        fn = getattr(getattr(getattr(torch.ops, parts[0]), parts[1]), parts[2])
    except (AttributeError, RuntimeError) as e:
        raise XschedError(f"unknown torch op {target!r}: {e}", stage="execute") from e
    if target in _RANDOM_INPLACE:
        return _FillFresh(fn, resolve(_RANDOM_INPLACE[target]))
    return fn


@cache
def has_random_tag(target: str) -> bool:
    """torch's own answer to whether an op draws from the RNG (its nondeterministic_seeded tag): the source of
    xsched.contracts.random_ops' table, and its answer for ops outside the table's namespaces."""
    try:
        fn = resolve(target)
    except XschedError:
        return False
    return torch.Tag.nondeterministic_seeded in getattr(fn, "tags", ())


def target_name(fn: Any) -> str:
    """The inverse of `resolve` for an OpOverload."""
    if isinstance(fn, torch._ops.OpOverload):
        return f"{fn.namespace}.{fn._schema.name.split('::')[-1]}.{fn._overloadname}"
    raise CaptureError(f"cannot encode op target {fn!r}: not an operator overload")


# ---- encoding of non-tensor values ----
def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def encode_literal(x: Any) -> Any:
    """A non-tensor Python argument -> JSON-able form. Tensors must be turned into refs by the caller."""
    if x is None or isinstance(x, (bool, int, str)):
        return x
    if isinstance(x, float):
        return x if math.isfinite(x) else {"float": repr(x)}
    if isinstance(x, (list, tuple, torch.Size)):
        return [encode_literal(y) for y in x]
    if isinstance(x, torch.dtype):
        return {"dtype": dtype_name(x)}
    if isinstance(x, torch.device):
        return {"device": str(x)}
    if isinstance(x, torch.layout):
        return {"layout": str(x).removeprefix("torch.")}
    if isinstance(x, torch.memory_format):
        return {"memory_format": str(x).removeprefix("torch.")}
    if isinstance(x, torch.Tensor):
        return encode_constant(x)
    raise CaptureError(f"cannot encode argument of type {type(x).__name__}: {x!r}")


def encode_constant(t: torch.Tensor) -> dict[str, Any]:
    """A small constant tensor inlined into an op's args."""
    if t.numel() > MAX_INLINE_NUMEL:
        raise CaptureError(
            f"constant tensor of shape {list(t.shape)} is too large to inline (> {MAX_INLINE_NUMEL} elements); "
            "register it as a buffer so it becomes a graph input"
        )
    if t.is_complex():
        raise CaptureError("complex constant tensors are not supported")
    return {"tensor": t.detach().cpu().tolist(), "dtype": dtype_name(t.dtype)}


# ---- decoding ----
def decode(x: Any, env: Mapping[str, torch.Tensor], device: torch.device) -> Any:
    """JSON-able argument -> Python value, looking refs up in `env` (value id -> tensor)."""
    if isinstance(x, list):
        return [decode(y, env, device) for y in x]
    if not isinstance(x, dict):
        return x
    if "ref" in x:
        if x["ref"] not in env:
            raise XschedError("input value is not available", stage="execute", value=x["ref"])
        return apply_view(env[x["ref"]], x.get("view", ()))
    if "dtype" in x and "tensor" in x:
        return torch.tensor(x["tensor"], dtype=getattr(torch, x["dtype"]), device=device)
    if "dtype" in x:
        return getattr(torch, x["dtype"])
    if "device" in x:
        return device
    if "layout" in x:
        return getattr(torch, x["layout"])
    if "memory_format" in x:
        return getattr(torch, x["memory_format"])
    if "float" in x:
        return float(x["float"])
    raise XschedError(f"cannot decode argument {x!r}", stage="execute")


def apply_view(t: torch.Tensor, chain: Sequence[Sequence[Any]]) -> Any:
    """Apply a folded view chain [[target, [args...]], ...] to a base tensor."""
    for target, args in chain:
        t = resolve(target)(t, *decode(list(args), {}, getattr(t, "device", torch.device("cpu"))))
    return t


def resolve_ref(ref: Mapping[str, Any], env: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The tensor a {"ref", "view"} mapping names (e.g. a forward output that is a view of its base)."""
    if ref["ref"] not in env:
        raise XschedError("value is not available", stage="execute", value=ref["ref"])
    return apply_view(env[ref["ref"]], ref.get("view", ()))


def iter_refs(x: Any) -> Iterator[Ref]:
    """Every tensor ref inside an encoded argument tree."""
    if isinstance(x, list):
        for y in x:
            yield from iter_refs(y)
    elif isinstance(x, dict):
        if "ref" in x:
            yield x  # type: ignore[misc]
        else:
            for y in x.values():
                yield from iter_refs(y)


def with_device_literals(x: Any, device: str) -> Any:
    """An encoded argument tree with every device literal naming `device` (the run device replaces it anyway)."""
    if isinstance(x, list):
        return [with_device_literals(y, device) for y in x]
    if not isinstance(x, dict) or "ref" in x:
        return x
    if set(x) == {"device"}:
        return {"device": device}
    return {k: with_device_literals(y, device) for k, y in x.items()}


# ---- running ----
def is_executable(op: Op) -> bool:
    """True when `op.call` says how to run it and its target is a known torch op."""
    if not isinstance(op.call, Mapping) or "outs" not in op.call:
        return False
    try:
        resolve(op.target)
    except XschedError:
        return False
    return True


def run_op(
    op: Op, env: Mapping[str, torch.Tensor], device: torch.device | str = "cpu", graph: Graph | None = None
) -> tuple[torch.Tensor, ...]:
    """Run `op` on `device` with inputs from `env`; its output tensors, in `op.outputs` order, in `graph`'s dtypes
    where the device's kernel makes others (xsched.contracts.device_dtypes; without a graph, as made)."""
    if not is_executable(op):
        raise XschedError(
            f"op {op.target!r} has no executable call (imported graphs carry costs only; capture a model to run it)",
            stage="execute",
            op=op.id,
        )
    device = torch.device(device)
    call = op.call
    assert call is not None
    try:
        args = decode(list(call.get("args", [])), env, device)
        kwargs = {k: decode(v, env, device) for k, v in call.get("kwargs", {}).items()}
        result = adapted(graph, op, resolve(op.target), device.type)(*args, **kwargs)
    except XschedError as e:
        raise XschedError(e.detail, stage="execute", op=op.id, value=e.value, device=str(device)) from e
    except (RuntimeError, TypeError, ValueError, IndexError) as e:
        raise XschedError(f"{op.target} failed: {e}", stage="execute", op=op.id, device=str(device)) from e
    outs = []
    for path in call["outs"]:
        r = result
        for i in path:
            r = r[i]
        outs.append(r)
    return tuple(outs)


# ---- realistic random inputs (for profiling one op in isolation) ----
_POSITIVE_OPS = {"log", "log2", "log10", "log1p", "sqrt", "rsqrt", "reciprocal", "pow", "lgamma", "digamma"}
_POSITIVE_ARGS = {"running_var", "var"}
_DIM_INDEX_OPS = {"gather", "scatter", "scatter_add", "scatter_reduce", "index_select", "index_add", "index_copy"}
_DIM_INDEX_OPS |= {"index_fill", "take_along_dim"}


def op_input_tensors(
    graph: Graph, op: Op, device: torch.device | str, generator: torch.Generator | None = None
) -> dict[str, torch.Tensor]:
    """Random inputs for `op` from its input values' shapes and dtypes, valid for the op, made on `device`.

    Floats are standard normal (positive where the op needs it: log, sqrt, a variance); bools are
    random masks; integer tensors used as indices are drawn below the size they index (embedding
    rows, gather's dim, loss classes, pooling windows), an embedding bag's offsets ascend from 0 within its
    indices, other integers below the smallest size.
    They are drawn on `device` itself (made on the host and copied, a GPU op's logits-sized input took seconds)
    by `generator` when it is on that device, else by a generator there seeded with its seed (default 0);
    on "meta" nothing is drawn (no data).
    """
    if not is_executable(op):
        raise XschedError("op has no executable call; cannot make inputs for it", stage="execute", op=op.id)
    device = torch.device(device)
    gen = _generator_on(device, generator)
    env: dict[str, torch.Tensor] = {}
    flat: dict[str, torch.Tensor] = {}  # the storage behind each input: filled and fixed up as a whole
    for vid in dict.fromkeys(op.inputs):
        v = graph.value[vid]
        if v.shape is None or v.dtype is None:
            raise XschedError("input value has no shape/dtype", stage="execute", op=op.id, value=vid)
        flat[vid], env[vid] = laid_out(v, lambda n, dt: _random_tensor((n,), dt, device, gen))
    if gen is None:
        return env
    bounds, positive, ascending = _input_constraints(op, env)
    for vid, t in flat.items():
        if t.dtype == torch.bool or t.is_floating_point() or t.is_complex():
            if vid in positive:
                t.abs_().add_(0.5)
            continue
        hi = bounds.get(vid, _fallback_bound(op, env))
        t.random_(0, max(int(hi), 1), generator=gen)
        if vid in ascending and t.numel():  # an embedding bag's offsets: sorted, the first bag at 0
            t.copy_(t.sort().values)
            t[0] = 0
    return env


def laid_out(v: Value, make: Callable[[int, torch.dtype], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(storage, tensor) for value `v` laid out as the graph records it (strides, storage offset; contiguous when
    it records none), the storage a 1-d tensor of `make(numel, dtype)`: an op measured on it sees the inputs eager
    gives it, so a view chain folded into its call (transpose, then view of SDPA's output) works as in eager."""
    shape, dtype = tuple(v.shape or ()), getattr(torch, v.dtype or "float32")
    stride, offset = layout(v)
    storage = make(storage_numel(shape, stride, offset), dtype)
    if v.stride is None and not offset:
        return storage, storage.view(shape)
    return storage, storage.as_strided(shape, stride, offset)


def _generator_on(device: torch.device, generator: torch.Generator | None) -> torch.Generator | None:
    """`generator` if it draws on `device`, else a fresh one there with its seed; None on "meta" (nothing to draw)."""
    if device.type == "meta":
        return None
    same = generator is not None and generator.device.type == device.type
    if same and (device.index is None or generator.device.index in (None, device.index)):
        return generator
    seed = generator.initial_seed() if generator is not None else 0
    return torch.Generator(device=device).manual_seed(seed)


def _random_tensor(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, gen: torch.Generator | None
) -> torch.Tensor:
    if gen is None:
        return torch.empty(shape, dtype=dtype, device=device)
    if dtype == torch.bool:
        return torch.rand(shape, generator=gen, device=device) < 0.5
    if dtype.is_floating_point or dtype.is_complex:
        return torch.randn(shape, generator=gen, dtype=dtype, device=device)
    return torch.zeros(shape, dtype=dtype, device=device)  # filled once the bounds are known


def _fallback_bound(op: Op, env: Mapping[str, torch.Tensor]) -> int:
    dims = [s for t in env.values() if t.is_floating_point() for s in t.shape if s > 0]
    return min(dims, default=16)


def _named_args(op: Op, env: Mapping[str, torch.Tensor]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Schema argument name -> (encoded argument, decoded argument with the placeholder inputs)."""
    fn = resolve(op.target)
    call = op.call or {}
    names = [a.name for a in fn._schema.arguments] if hasattr(fn, "_schema") else []
    encoded = {**dict(zip(names, call.get("args", []))), **call.get("kwargs", {})}
    return encoded, {k: decode(v, env, torch.device("cpu")) for k, v in encoded.items()}


def _input_constraints(op: Op, env: Mapping[str, torch.Tensor]) -> tuple[dict[str, int], set[str], set[str]]:
    """(value id -> exclusive upper bound for index values, value ids that must be positive, value ids of integers
    that ascend from 0)."""
    encoded, named = _named_args(op, env)
    packet = op.target.split(".")[1].removesuffix("_").removeprefix("_")
    bounds: dict[str, int] = {}
    positive: set[str] = set()
    ascending: set[str] = set()

    def bound(argname: str, hi: int) -> None:
        for r in iter_refs(encoded.get(argname)):
            bounds[r["ref"]] = min(bounds.get(r["ref"], hi), hi)

    self_t = named.get("self", named.get("input"))
    if "embedding" in packet and "indices" in named:
        w = named.get("weight")
        rows = w.shape[0] if isinstance(w, torch.Tensor) else int(named.get("num_weights", 1))
        bound("indices", rows)
        if "bag" in packet:  # each bag starts within the indices, after the one before; a max's row is a row
            indices, offsets, grad = named["indices"], named.get("offsets"), named.get("grad")
            bound("offsets", indices.numel() + 1 if isinstance(indices, torch.Tensor) else 1)
            bags = grad if isinstance(grad, torch.Tensor) else offsets
            bound("offset2bag", bags.shape[0] if isinstance(bags, torch.Tensor) and bags.dim() else 1)
            bound("maximum_indices", rows)
            ascending.update(r["ref"] for name in ("offsets", "offset2bag") for r in iter_refs(encoded.get(name)))
    elif packet.startswith("nll_loss") or packet.startswith("cross_entropy") or packet.startswith("multi_margin"):
        if isinstance(self_t, torch.Tensor):
            bound("target", self_t.shape[1] if self_t.dim() >= 2 else self_t.shape[0])
    elif packet in _DIM_INDEX_OPS and isinstance(self_t, torch.Tensor) and "dim" in named:
        bound("index", self_t.shape[named["dim"]] if self_t.dim() else 1)
    elif packet in {"index", "index_put", "index_put_impl", "unsafe_index", "unsafe_index_put"}:
        for k, r in enumerate(encoded.get("indices") or []):
            if isinstance(r, dict) and "ref" in r and isinstance(self_t, torch.Tensor):
                bounds[r["ref"]] = min(bounds.get(r["ref"], self_t.shape[k]), self_t.shape[k])
    elif "pool" in packet and "indices" in named and isinstance(self_t, torch.Tensor):
        bound("indices", math.prod(self_t.shape[2:]) if self_t.dim() > 2 else 1)
    for name in _POSITIVE_ARGS:
        positive.update(r["ref"] for r in iter_refs(encoded.get(name)))
    if packet in _POSITIVE_OPS:
        positive.update(r["ref"] for r in iter_refs(encoded.get("self")))
    return bounds, positive, ascending
