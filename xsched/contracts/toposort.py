"""Cycles and deterministic topological orders over ids: the graph's order check, the importers' sort and hier's
partition use them."""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Mapping
from typing import Any

from xsched.errors import GraphError


def find_cycle(ops: Iterable[Any], produced_by: Mapping[str, str]) -> list[str]:
    """Op ids along one cycle (first repeated at the end), or [] when the ops form a DAG."""
    preds = {o.id: [produced_by[v] for v in o.inputs if v in produced_by] for o in ops}
    state: dict[str, int] = {}  # 1 = on stack, 2 = done
    for root in preds:
        if state.get(root):
            continue
        stack: list[tuple[str, int]] = [(root, 0)]
        path: list[str] = []
        while stack:
            node, k = stack.pop()
            if k == 0:
                state[node] = 1
                path.append(node)
            if k < len(preds[node]):
                stack.append((node, k + 1))
                nxt = preds[node][k]
                if state.get(nxt) == 1:
                    return path[path.index(nxt) :] + [nxt]
                if not state.get(nxt):
                    stack.append((nxt, 0))
            else:
                state[node] = 2
                path.pop()
    return []


def topological_order(ids: Iterable[str], edges: Iterable[tuple[str, str]], key: Any = None) -> list[str]:
    """Deterministic (lexicographic by `key`) topological order; raises GraphError on a cycle."""
    ids = list(ids)
    key = key or (lambda x: x)
    succ: dict[str, list[str]] = {i: [] for i in ids}
    indeg = {i: 0 for i in ids}
    for a, b in edges:
        succ[a].append(b)
        indeg[b] += 1
    heap = [(key(i), i) for i in ids if indeg[i] == 0]
    heapq.heapify(heap)
    order: list[str] = []
    while heap:
        _, i = heapq.heappop(heap)
        order.append(i)
        for j in succ[i]:
            indeg[j] -= 1
            if indeg[j] == 0:
                heapq.heappush(heap, (key(j), j))
    if len(order) != len(ids):
        stuck = next(i for i in ids if indeg[i] > 0)
        raise GraphError("graph has a cycle", op=stuck)
    return order
