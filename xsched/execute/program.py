"""Inline programs: a one-device slice of plan steps (computes and frees) generated as one Python function.

The executor's step functions pay, per op, a closure per argument, a list of arguments, a loop over the
outputs and a locked store method per value. On small models that Python is as long as the kernels, so a
slice that runs in the calling thread (one device, no copy: nothing to overlap) is turned, once, into
straight-line source in the manner of torch.fx's code generation: each op is one call on its store lookups and
constants, each output a size check and a dict store, each free a dict delete. It keeps the step functions'
semantics: the same kernels (in-place twins, RNG replay), the same byte accounting and peak as
DeviceStore.put/drop (only kept in locals until the slice ends), the watched first values, and errors that name
the step, op, value and device. A lanes run's compute-lane tasks are programs too (`step_program(shared=True)`):
there the copy and free lanes use the store meanwhile, so outputs and frees go through its locked put and drop.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from xsched.contracts.device_dtypes import adapted
from xsched.contracts.graph import Graph
from xsched.contracts.plan import Compute, Free, Plan
from xsched.contracts.torch_ops import decode, resolve
from xsched.errors import XschedError
from xsched.execute.compiled import (
    _INPLACE,
    _direct,
    _has_ref,
    compile_inplace,
    compile_op,
    getter,
    view_fn,
    with_rng,
)
from xsched.interpret import at_step, wrong_size


@dataclass(frozen=True)
class PreparedPlan:
    """What code generation reads of a prepared plan: the executor builds it once, the programs never see the
    executor itself."""

    graph: Graph
    plan: Plan
    dev: Mapping[str, Any]  # plan device -> torch.device
    nbytes: Mapping[str, int]
    random: frozenset[str]  # ops that draw from an RNG
    recomputed_random: frozenset[str]  # random ops computed more than once: their RNG state is saved
    reuse: Mapping[int, str]  # compute step -> the input it may overwrite in place (compiled.reusable_inputs)
    watch: frozenset[str]  # values whose first computed tensor a run keeps


class _Source:
    """Lines of the generated function and the objects its names are bound to."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.ns: dict[str, Any] = {}

    def bind(self, obj: Any, prefix: str = "c") -> str:
        name = f"{prefix}{len(self.ns)}"
        self.ns[name] = obj
        return name

    def emit(self, line: str, depth: int = 2) -> None:
        self.lines.append("    " * depth + line)


def _arg(src: _Source, x: Any, device: Any) -> str:
    """A Python expression for one encoded argument, reading refs from the store dict `T`."""
    if not _has_ref(x):
        return src.bind(getter(x, device)(None))
    if isinstance(x, dict) and set(x) == {"ref"}:
        return f"T[{x['ref']!r}]"
    if isinstance(x, list):
        return "[" + ", ".join(_arg(src, y, device) for y in x) + "]"
    if isinstance(x, dict) and set(x) == {"ref", "view"}:  # the folded view chain, applied call by call
        expr = f"T[{x['ref']!r}]"
        for target, args in x["view"]:
            fn = src.bind(view_fn(target, len(args)), "v")
            expr = f"{fn}({', '.join([expr, *(src.bind(a) for a in decode(list(args), {}, device))])})"
        return expr
    return f"{src.bind(getter(x, device), 'g')}(T)"


def _compute(src: _Source, ex: PreparedPlan, i: int, s: Compute, shared: bool) -> None:
    op, dev = ex.graph.op[s.op], ex.dev[s.device]
    call = op.call or {}
    if op.id in ex.random:  # through the kernel closure: the generator lock and the replay of recomputations
        kernel = compile_inplace(op, dev) if i in ex.reuse else compile_op(op, dev, graph=ex.graph)
        run = src.bind(with_rng(op, kernel, dev, record=op.id in ex.recomputed_random), "k")
        src.emit(f"r = {run}(T, L)")
        paths: list[tuple[int, ...]] = [(j,) for j in range(len(op.outputs))]
    else:
        compile_op(op, dev)  # the same checks (an executable call) and errors as the step functions
        direct = _direct(resolve(_INPLACE[op.target] if i in ex.reuse else op.target))
        fn = src.bind(adapted(ex.graph, op, direct, dev.type), "f")
        args = [_arg(src, a, dev) for a in call.get("args", [])]
        kwargs = call.get("kwargs", {})
        consts = {k: getter(v, dev)(None) for k, v in kwargs.items() if not _has_ref(v)}
        args += [f"{k}={_arg(src, v, dev)}" for k, v in kwargs.items() if _has_ref(v)]
        if consts:
            args.append(f"**{src.bind(consts)}")
        src.emit(f"r = {fn}({', '.join(args)})")
        paths = [tuple(p) for p in call["outs"]]
    for j, (v, path) in enumerate(zip(op.outputs, paths)):
        n = ex.nbytes[v]
        src.emit(f"o = r{''.join(f'[{k}]' for k in path)}")
        src.emit(f"if o.nbytes != {n}: raise size({i}, {j}, o.nbytes)")
        if shared:
            src.emit(f"put({v!r}, o)")
        else:
            src.emit(f"if {v!r} not in T:")
            src.emit(f"b += {n}", 3)
            src.emit("if b > p: p = b", 3)
            src.emit(f"T[{v!r}] = o")
        if v in ex.watch:
            src.emit(f"F.setdefault({v!r}, o)")
    src.emit("del r, o" if op.outputs else "del r")  # a later free must release the outputs, as planned


def _free(src: _Source, ex: PreparedPlan, s: Free, shared: bool) -> None:
    if shared:
        src.emit(f"drop({s.value!r})")
        return
    src.emit(f"if {s.value!r} in R: R.discard({s.value!r})")
    src.emit(f"else: del T[{s.value!r}]")
    src.emit(f"b -= {ex.nbytes[s.value]}")


def inline_program(ex: PreparedPlan, start: int, stop: int) -> Callable[[Any], None]:
    """Steps [start, stop) of `ex.plan` (computes and frees on one device) as one function of the run state."""
    return step_program(ex, range(start, stop))


def step_program(ex: PreparedPlan, idx: Sequence[int], *, shared: bool = False) -> Callable[[Any], None]:
    """Steps `idx` of `ex.plan` (computes and frees on one device, in plan order) as one function of the run state.
    `shared`: other threads use the device's store meanwhile (a lanes run's compute lane, beside its copy and free
    lanes): each output and free goes through the store's locked put and drop, as the step functions do, so its
    bytes and peak count every lane's; else they are counted in locals and written back once."""
    steps = [ex.plan.steps[i] for i in idx]
    if any(not isinstance(s, (Compute, Free)) for s in steps) or len({s.device for s in steps}) > 1:  # type: ignore[union-attr]
        raise XschedError(f"steps {_span(idx)} are not computes and frees on one device", stage="execute")
    src = _Source()
    for i, s in zip(idx, steps):
        src.emit(f"i = {i}")
        if isinstance(s, Compute):
            _compute(src, ex, i, s, shared)
        else:
            _free(src, ex, s, shared)
    device = steps[0].device if steps else ex.plan.devices[0]  # type: ignore[union-attr]
    src.ns.update(size=lambda i, j, got: _size(ex, i, j, got), failed=lambda i, e: _failed(ex, i, e), D=device)
    body = "\n".join(src.lines) or "        pass"
    first = idx[0] if len(idx) else 0
    # shared: the locked store methods; else the byte count in locals, written back however the program ends
    head, tail = ("put, drop = S.put, S.drop", "") if shared else ("b, p = S.bytes, S.peak", _WRITE_BACK)
    text = f"""def program(st):
    S = st.stores[D]
    T, R, F, L = S.tensors, S.reserved, st.first, st.rng
    {head}
    i = {first}
    try:
{body}
    except Exception as e:
        x = failed(i, e)
        if x is e:
            raise
        raise x from e
{tail}"""
    exec(compile(text, f"<xsched program {ex.graph.name} {_span(idx)}>", "exec"), src.ns)
    return src.ns["program"]


_WRITE_BACK = """    finally:
        S.bytes, S.peak = b, p
"""


def _span(idx: Sequence[int]) -> str:
    """Steps `idx` for a message: [start, stop) when they follow on, else the first and last."""
    if len(idx) and list(idx) == list(range(idx[0], idx[-1] + 1)):
        return f"[{idx[0]}, {idx[-1] + 1})"
    return f"{idx[0]}..{idx[-1]}" if len(idx) else "[]"


def gather(
    refs: Sequence[Mapping[str, Any] | None], devices: Sequence[Any]
) -> Callable[[Mapping[str, Any]], list[Any]]:
    """`refs` (None: no value) read from a store dict by one generated function, views applied; a missing value
    raises KeyError."""
    src = _Source()
    items = ["None" if r is None else _arg(src, r, d) for r, d in zip(refs, devices)]
    exec(compile(f"def gather(T):\n    return [{', '.join(items)}]\n", "<xsched gather>", "exec"), src.ns)
    return src.ns["gather"]


def _size(ex: PreparedPlan, i: int, j: int, got: int) -> XschedError:
    s = ex.plan.steps[i]
    op = ex.graph.op[s.op]  # type: ignore[union-attr]
    return wrong_size(op, op.outputs[j], got, ex.nbytes[op.outputs[j]], s.device)  # type: ignore[union-attr]


def _failed(ex: PreparedPlan, i: int, e: Exception) -> Exception:
    """The error a step function would have raised for `e`, with the step named."""
    s = ex.plan.steps[i]
    if isinstance(s, Free) and isinstance(e, KeyError):
        e = XschedError("free of a value that is not resident", stage="execute", value=s.value, device=s.device)
    elif isinstance(s, Compute) and isinstance(e, KeyError):
        e = XschedError("input value is not available", stage="execute", op=s.op, value=str(e.args[0]))
    elif isinstance(s, Compute) and isinstance(e, (RuntimeError, TypeError, ValueError, IndexError)):
        op = ex.graph.op[s.op]
        e = XschedError(f"{op.target} failed: {e}", stage="execute", op=op.id, device=str(ex.dev[s.device]))
    return at_step(e, i, s) if isinstance(e, XschedError) else e
