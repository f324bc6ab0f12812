"""Ops pre-decoded into closures: an Op's JSON call turned once into `store -> output tensors`, with RNG replay."""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from xsched.allocator.placement import aliases
from xsched.contracts.device_dtypes import adapted
from xsched.contracts.graph import Graph, Op
from xsched.contracts.layout import layout
from xsched.contracts.torch_ops import decode, is_executable, resolve
from xsched.errors import XschedError
from xsched.execute.rng import get_rng, set_rng

Store = Mapping[str, torch.Tensor]
Getter = Callable[[Store], Any]
Kernel = Callable[[Store], tuple[torch.Tensor, ...]]

# One lock per torch generator: random ops (first runs and replays) swap the generator's state, so two
# of them on different worker threads must not interleave.
_RNG_LOCKS: dict[str, threading.Lock] = {}
_RNG_LOCKS_GUARD = threading.Lock()


def _rng_lock(device: torch.device) -> threading.Lock:
    key = f"{device.type}:{device.index or 0}" if device.type == "cuda" else "cpu"
    with _RNG_LOCKS_GUARD:
        return _RNG_LOCKS.setdefault(key, threading.Lock())


def _has_ref(x: Any) -> bool:
    if isinstance(x, list):
        return any(_has_ref(y) for y in x)
    return isinstance(x, dict) and ("ref" in x or any(_has_ref(y) for y in x.values()))


def _direct(fn: Any) -> Callable[..., Any]:
    """The C++ callable behind an OpOverload (its __call__ only forwards to it): one Python frame less per call."""
    return getattr(fn, "_op", fn) if isinstance(fn, torch._ops.OpOverload) else fn


# Folded views as the Tensor methods that run the same aten op: PyTorch's generated bindings parse their
# arguments faster than an OpOverload's generic schema path (~0.3-0.5 us of a 1-2 us call, on every view of
# every call). Value: the most positional arguments the method takes (expand's `implicit` is keyword-only).
_VIEW_METHODS = {
    "aten.view.default": (torch.Tensor.view, 1),
    "aten.t.default": (torch.Tensor.t, 0),
    "aten.transpose.int": (torch.Tensor.transpose, 2),
    "aten.permute.default": (torch.Tensor.permute, 1),
    "aten.expand.default": (torch.Tensor.expand, 1),
    "aten.unsqueeze.default": (torch.Tensor.unsqueeze, 1),
    "aten.detach.default": (torch.Tensor.detach, 0),
}


def view_fn(target: str, nargs: int) -> Callable[..., Any]:
    """The callable applying view `target` to a tensor and `nargs` more positional arguments."""
    method, most = _VIEW_METHODS.get(target, (None, -1))
    return method if method is not None and nargs <= most else _direct(resolve(target))


def _view_fns(chain: Sequence[Sequence[Any]], device: torch.device) -> list[tuple[Callable[..., Any], list[Any]]]:
    return [(view_fn(target, len(args)), decode(list(args), {}, device)) for target, args in chain]


def getter(x: Any, device: torch.device) -> Getter:
    """A closure producing the decoded argument from a store; constants are decoded now, once."""
    if not _has_ref(x):
        const = decode(x, {}, device)
        return lambda store: const
    if isinstance(x, dict) and "ref" in x:
        vid = x["ref"]
        views = _view_fns(x.get("view", ()), device)
        if not views:
            return lambda store: store[vid]
        if len(views) == 1:
            ((fn, a),) = views
            return lambda store: fn(store[vid], *a)

        def viewed(store: Store) -> Any:
            t = store[vid]
            for fn, args in views:
                t = fn(t, *args)
            return t

        return viewed
    if isinstance(x, list):
        parts = [getter(y, device) for y in x]
        return lambda store: [p(store) for p in parts]
    raise XschedError(f"cannot decode argument {x!r}", stage="execute")


def _picker(paths: Sequence[Sequence[int]]) -> Callable[[Any], tuple[Any, ...]]:
    paths = [tuple(p) for p in paths]
    if paths == [()]:
        return lambda r: (r,)
    if paths == [(0,)]:
        return lambda r: (r[0],)
    if all(len(p) == 1 for p in paths):
        idx = [p[0] for p in paths]
        return lambda r: tuple([r[i] for i in idx])

    def pick(r: Any) -> tuple[Any, ...]:
        out = []
        for path in paths:
            x = r
            for i in path:
                x = x[i]
            out.append(x)
        return tuple(out)

    return pick


def compile_op(op: Op, device: torch.device, target: str | None = None, graph: Graph | None = None) -> Kernel:
    """`store -> outputs of op` on `device`, with the call's JSON decoded once (same semantics as ops.run_op, with
    `graph`); `target` runs another op (an in-place twin) on the same arguments."""
    if not is_executable(op):
        raise XschedError(
            f"op {op.target!r} has no executable call (imported graphs carry costs only; capture a model to run it)",
            stage="execute",
            op=op.id,
        )
    call = op.call or {}
    fn = adapted(graph, op, _direct(resolve(target or op.target)), device.type)
    args = [getter(a, device) for a in call.get("args", [])]
    kwargs = [(k, getter(v, device)) for k, v in call.get("kwargs", {}).items()]
    pick = _picker(call["outs"])
    consts = {k: g(None) for k, g in kwargs if not _has_ref(call["kwargs"][k])}  # type: ignore[arg-type]
    kwargs = [(k, g) for k, g in kwargs if k not in consts]

    def kernel(store: Store) -> tuple[torch.Tensor, ...]:
        try:
            if kwargs:
                result = fn(*[a(store) for a in args], **consts, **{k: g(store) for k, g in kwargs})
            else:
                result = fn(*[a(store) for a in args], **consts)
        except KeyError as e:
            raise XschedError("input value is not available", stage="execute", op=op.id, value=str(e.args[0])) from e
        except (RuntimeError, TypeError, ValueError, IndexError) as e:
            raise XschedError(f"{op.target} failed: {e}", stage="execute", op=op.id, device=str(device)) from e
        return pick(result)

    return kernel


class RngLog:
    """Generator states saved at the first run of each random op, replayed on its recomputation."""

    def __init__(self) -> None:
        self.states: dict[str, torch.Tensor] = {}


def with_rng(
    op: Op, kernel: Kernel, device: torch.device, record: bool = True
) -> Callable[[Store, RngLog], tuple[torch.Tensor, ...]]:
    """Wrap a random op's kernel: the first run records the generator state, a rerun draws the same numbers
    and then leaves the generator where it was, so the run's random stream matches eager PyTorch. Without
    `record` (an op the plan computes once) it only holds the generator's lock: there is nothing to replay."""
    lock = _rng_lock(device)
    if not record:

        def locked(store: Store, log: RngLog) -> tuple[torch.Tensor, ...]:
            with lock:
                return kernel(store)

        return locked

    def run(store: Store, log: RngLog) -> tuple[torch.Tensor, ...]:
        with lock:
            saved = log.states.get(op.id)
            if saved is None:
                log.states[op.id] = get_rng(device)
                return kernel(store)
            resume = get_rng(device)
            set_rng(device, saved)
            try:
                return kernel(store)
            finally:
                set_rng(device, resume)

    return run


# Functional elementwise ops and their in-place twins (same kernel, so bitwise the same result): eager PyTorch
# runs ReLU(inplace=True) and `out += identity` this way; the captured graph is functional and would allocate.
_INPLACE = {
    "aten.relu.default": "aten.relu_.default",
    "aten.add.Tensor": "aten.add_.Tensor",
    "aten.add.Scalar": "aten.add_.Scalar",
    "aten.sub.Tensor": "aten.sub_.Tensor",
    "aten.mul.Tensor": "aten.mul_.Tensor",
    "aten.mul.Scalar": "aten.mul_.Scalar",
    "aten.div.Tensor": "aten.div_.Tensor",
    "aten.div.Scalar": "aten.div_.Scalar",
    "aten.masked_fill.Scalar": "aten.masked_fill_.Scalar",
    "aten.gelu.default": "aten.gelu_.default",
    "aten.sigmoid.default": "aten.sigmoid_.default",
    "aten.tanh.default": "aten.tanh_.default",
}


def reusable_inputs(graph: Graph, steps: Sequence[Any], watch: frozenset[str]) -> dict[int, str]:
    """Compute steps that may overwrite their first input: step index -> that input's value id.

    The op has an in-place twin, its first argument is a plain ref to an activation of the output's shape,
    dtype and layout that appears in no other argument, the plan frees it on that device with no read between this step and
    the free, no copy ever reads it from that device (a copy lane could read it concurrently), it is not watched,
    and no op that produces or reads it returns an alias of it. Residency and byte accounting are unchanged:
    the value stays resident, with dead contents, until its free.
    """
    from xsched.contracts.plan import Compute, Copy, Free

    copied = {(s.value, s.src) for s in steps if isinstance(s, Copy)}
    aliased = {v for o in graph.ops if aliases(o) for v in (*o.inputs, *o.outputs)}
    out: dict[int, str] = {}
    for i, s in enumerate(steps):
        if not isinstance(s, Compute) or (op := graph.op[s.op]).target not in _INPLACE or not op.call:
            continue
        args = op.call.get("args", [])
        first = args[0] if args else None
        if not (isinstance(first, dict) and set(first) == {"ref"} and len(op.outputs) == 1):
            continue
        x, y = graph.value[first["ref"]], graph.value[op.outputs[0]]
        rest = [*args[1:], *op.call.get("kwargs", {}).values()]
        if (
            x.kind != "activation"
            or x.id in watch
            or x.id in aliased
            or (x.id, s.device) in copied
            or x.shape != y.shape
            or x.dtype != y.dtype
            or layout(x) != layout(y)  # the in-place twin leaves x's layout, which the output's readers must get
            or x.shape is None
            or _mentions(rest, x.id)
        ):
            continue
        for t in steps[i + 1 :]:
            if isinstance(t, Free) and t.value == x.id and t.device == s.device:
                out[i] = x.id
                break
            if isinstance(t, Compute) and t.device == s.device and x.id in graph.op[t.op].inputs:
                break
    return out


def _mentions(x: Any, vid: str) -> bool:
    if isinstance(x, list):
        return any(_mentions(y, vid) for y in x)
    return isinstance(x, dict) and (x.get("ref") == vid or any(_mentions(y, vid) for y in x.values()))


def compile_inplace(op: Op, device: torch.device) -> Kernel:
    """Like compile_op, but running the op's in-place twin on its first argument (see reusable_inputs)."""
    return compile_op(op, device, target=_INPLACE[op.target])
