"""Capturing a model whose body is N identical blocks (an nn.ModuleList or nn.Sequential: GPT-2's `h`, Llama's
`layers`) at the cost of a few: the graphs of the model cut to k, k+1 and k+2 blocks, lined up by
xsched.capture.periodic and extrapolated to N blocks. The k+2 graph is the check: the extrapolation from k and k+1
must give it exactly (every record, the fingerprint), else, and wherever the graphs do not line up, the whole model
is captured (with a one-line notice); the graph returned is always the one a full capture gives."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import sys
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from torch import nn

from xsched.capture.block_ops import block_ops, first_unlike, recording
from xsched.capture.periodic import Fit, Mismatch, Records, fit, predict
from xsched.capture.reuse import recall, remember, scoped
from xsched.contracts.graph import Graph

BLOCKS_KEPT = 3  # k, the smallest cut: then each run has copies 1 and 2, beyond its first, to fit its step from
WORTH_FROM = 16  # blocks: with fewer, the cut traces (3 + 4 + 5 blocks) and the check cost about a full trace
_CALLS = "block calls"  # what `recorded_for_reuse` keeps in the capture scope
_FIELDS = [f.name for f in dataclasses.fields(Graph)]


def repeated_blocks(model: nn.Module) -> tuple[str, int] | None:
    """The path and length of the model's largest list (by parameters) of at least two blocks of one class with the
    same parameter and buffer names, shapes and dtypes; None if it has none."""
    best: tuple[int, str, int] | None = None
    for path, m in model.named_modules():
        if not isinstance(m, (nn.ModuleList, nn.Sequential)) or len(m) < 2:
            continue
        signatures = {_signature(block) for block in m}
        if len(signatures) == 1:
            size = sum(p.numel() for p in m.parameters())
            if best is None or size > best[0]:
                best = (size, path, len(m))
    return None if best is None else (best[1], best[2])


def _signature(block: nn.Module) -> tuple:
    """What two blocks must share to trace alike: every module's class, mode and hooks (a backward hook on one block
    would not show in a forward), and every parameter's and buffer's metadata."""
    state = [*block.named_parameters(remove_duplicate=False), *block.named_buffers(remove_duplicate=False)]
    modules = [(k, type(m), m.training, *map(len, _hooks(m))) for k, m in block.named_modules(remove_duplicate=False)]
    return tuple(modules), tuple((k, tuple(t.shape), t.dtype, t.requires_grad) for k, t in state)


def _hooks(m: nn.Module) -> tuple:
    return (m._forward_hooks, m._forward_pre_hooks, m._backward_hooks, m._backward_pre_hooks)


def with_blocks(model: nn.Module, path: str, count: int) -> nn.Module:
    """A shallow copy of `model` whose list at `path` holds its first `count` blocks; everything else (parameters,
    buffers, other modules) is shared with `model`, which is left as it was."""
    return _cut(model, path.split(".") if path else [], count)


def _cut(module: nn.Module, names: list[str], count: int) -> nn.Module:
    clone = copy.copy(module)
    # its own table of children (copy.copy shares the dict), so the cut does not reach the original
    children = dict(module._modules)
    if names:
        children[names[0]] = _cut(module._modules[names[0]], names[1:], count)
    else:
        children = dict(list(children.items())[:count])
    object.__setattr__(clone, "_modules", children)
    return clone


def capture_blocks(
    model: nn.Module,
    inputs: tuple,
    inference: bool,
    trace: Callable[[nn.Module], Graph],
    full: Callable[[], Graph],
    least: int = WORTH_FROM,
) -> Graph:
    """`full()`'s graph, found by `trace` of the model cut to a few blocks where its body repeats at least `least`
    times; `full()` where it does not, or where the blocks act differently or the cut graphs do not line up
    (saying why on stderr)."""
    found = repeated_blocks(model)
    k = BLOCKS_KEPT
    if found is None or found[1] < max(least, k + 3):
        return full()
    path, n = found
    try:
        # the cut graphs see blocks 0..k+1 only: every later block must run the very calls block 1 runs (as seen by
        # the loss outputs' fake forward of a training step, `recorded_for_reuse`, or by a fake forward of our own)
        calls = None if inference else recall(_CALLS, model, inputs)
        unlike = first_unlike(calls or block_ops(model, model.get_submodule(path), inputs, inference))
        if unlike is not None:
            raise Mismatch(f"block {unlike} (or the model right after it) runs other ops than block 1")
        graphs = [trace(with_blocks(model, path, k + i)) for i in range(3)]
        return extrapolate(graphs[0], graphs[1], graphs[2], n - k)
    except Exception as e:  # noqa: BLE001 - whatever failed, the full capture is the answer (or says the error)
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        print(f"xsched: capturing every block of {path or 'the model'}: {why}", file=sys.stderr)
        return full()


@contextlib.contextmanager
def recorded_for_reuse(model: nn.Module, inputs: tuple) -> Iterator[None]:
    """Around a fake forward of a training step (inside its FakeTensorMode) in a capture scope: the calls of the
    model's repeated blocks are kept for a capture with `reuse_blocks`, which then need not run its own."""
    found = repeated_blocks(model) if scoped() else None
    if found is None or found[1] < WORTH_FROM:
        yield
        return
    with recording(model.get_submodule(found[0])) as seen:
        yield
    if seen.saw_any():  # nothing when the scope answered the forward without running it
        remember(_CALLS, model, inputs, seen.calls())


def extrapolate(small: Graph, big: Graph, check: Graph, blocks_added: int) -> Graph:
    """The graph `blocks_added` blocks beyond `small`, fitted on `small` and `big` (one block more); raises Mismatch
    unless the fit gives `check` (two blocks more) exactly."""
    records = _read(small), _read(big)
    fits = {f: fit(records[0][f], records[1][f]) for f in _FIELDS}
    predicted = _graph(small, fits, 2)
    if predicted != check or predicted.fingerprint != check.fingerprint:
        raise Mismatch("the cut graphs predict the next one wrongly")
    return _graph(small, fits, blocks_added)


def _read(g: Graph) -> dict[str, Records]:
    """Each field of `g` as records, keyed with what they refer to (an output list of bare ids, or mm ops of one
    kind, would otherwise line up anyhow): an op with the values it reads, a value with the op that makes it, any
    other record with the values it names; a value's shape is in its key as it is (not read as numbers that grow)."""
    plain = {v.id: f"{key}{v.shape}" for v, key in zip(g.values, Records.read(g.values).keys)}
    ops = Records.read(g.ops, ["|".join(plain[v] for v in o.inputs) for o in g.ops])
    made_by = {v: key for o, key in zip(g.ops, ops.keys) for v in o.outputs}
    values = Records.read(g.values, [f"{v.shape}|{made_by.get(v.id, 'input')}" for v in g.values])
    value_key = dict(zip((v.id for v in g.values), values.keys))
    read = {"ops": ops, "values": values}
    for f in _FIELDS:
        if f not in read:
            items = _records(g, f)
            read[f] = Records.read(items, ["|".join(value_key[v] for v in _named(x, value_key)) for x in items])
    return read


def _named(record: Any, values: Mapping[str, str]) -> list[str]:
    """The value ids a record holds, in order."""
    if isinstance(record, str):
        return [record] if record in values else []
    if isinstance(record, (list, tuple)):
        return [v for x in record for v in _named(x, values)]
    if isinstance(record, Mapping):
        return [v for kv in record.items() for v in _named(kv, values)]
    return []


def _records(g: Graph, name: str) -> list[Any]:
    """One field of a graph as a sequence of records: a tuple's items, a mapping's (key, value) pairs, or itself."""
    value = getattr(g, name)
    if isinstance(value, tuple):
        return list(value)
    if isinstance(value, Mapping):
        return list(value.items())
    return [value]


def _graph(like: Graph, fits: Mapping[str, Fit], blocks_added: int) -> Graph:
    fields: dict[str, Any] = {}
    for name, f in fits.items():
        items = predict(f, blocks_added)
        value = getattr(like, name)
        if isinstance(value, tuple):
            fields[name] = tuple(items)
        elif isinstance(value, Mapping):
            fields[name] = dict(items)
        else:
            fields[name] = items[0]
    return Graph(**fields)
