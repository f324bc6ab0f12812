"""Lean checkpointing's orders and windows (the checkpoint search's last resort, `checkpoint.lean_search`): weight
gradients made late, and windows of the backward run again at the end to make their gradients there."""

from __future__ import annotations

from collections.abc import Mapping

from xsched.contracts.graph import Graph, Op
from xsched.contracts.plan import Compute

MAX_WINDOW_GRADS = 16  # windows span the k biggest gradients' ops, k up to this
BASES = 3  # the leanest plans without a window, that each window is tried after
WINDOW_BASES = 24  # the best window is then tried after the leanest this many


def late_gradient_order(graph: Graph, ends: set[str]) -> list[Op]:
    """Graph order, with each backward op that only makes gradients (read by nothing) moved to just before the
    last other reader of its backward inputs: those are held until then anyway, and the heavy ops between run
    without its gradient (its forward inputs are recomputed)."""
    place = {op.id: float(i) for i, op in enumerate(graph.ops)}
    for op in graph.ops:
        if op.phase != "bwd" or not all(v in ends and not graph.consumers.get(v) for v in op.outputs):
            continue
        backward_inputs = [v for v in op.inputs if v in graph.producer and graph.op[graph.producer[v]].phase == "bwd"]
        last = max((graph.op_index[c] for v in backward_inputs for c in graph.consumers[v] if c != op.id), default=-1)
        if last > graph.op_index[op.id]:
            place[op.id] = last - 0.5
    return sorted(graph.ops, key=lambda op: place[op.id])


def remake_window(graph: Graph, window: set[str], homes: Mapping[str, str], device: str) -> list[Compute]:
    """The computes that make the window's outputs again after the whole backward: the window's ops and the
    forward ops they need, recomputed from the homed inputs; backward values from outside the window are read
    as made the first time (held until then)."""
    made_outside = {v for op in graph.ops if op.phase == "bwd" and op.id not in window for v in op.outputs}
    have = set(homes) | made_outside
    todo, ops = list(window), set()
    while todo:
        o = todo.pop()
        if o not in ops:
            ops.add(o)
            todo += [graph.producer[u] for u in graph.op[o].inputs if u not in have]
    return [Compute(op.id, device) for op in graph.ops if op.id in ops]


def gradient_windows(graph: Graph, ends: set[str]) -> list[set[str]]:
    """The backward ops from the first to the last of the k backward ops making the most gradient bytes, for k
    up to `MAX_WINDOW_GRADS`: made again at the end, those gradients are not held while the ops after them run."""
    backward = [i for i, op in enumerate(graph.ops) if op.phase == "bwd"]
    made = {i: sum(graph.value[v].nbytes for v in graph.ops[i].outputs if v in ends) for i in backward}
    biggest = sorted((i for i in backward if made[i] > 0), key=lambda i: -made[i])
    windows: list[set[str]] = []
    for k in range(1, min(len(biggest), MAX_WINDOW_GRADS) + 1):
        lo, hi = min(biggest[:k]), max(biggest[:k])
        window = {graph.ops[i].id for i in backward if lo <= i <= hi}
        if window not in windows:
            windows.append(window)
    return windows
