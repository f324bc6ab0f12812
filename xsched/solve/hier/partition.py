"""H-Partition (HiREmate, Algorithm 1): convex groups of a DAG, level by level, chosen greedily by boundary size.

A candidate group for node x holds every node on a path from a(x), the closest node through which every path into
x passes (x's immediate dominator, with a virtual root before the sources), to x: such a set has one head outside
it that all its outside edges come from (the paper's Property 1), so it is convex, and so is the union of two
intersecting candidates (its Theorem A.4), which is how candidates grow when a group is formed.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from xsched.contracts.toposort import topological_order

ROOT = -1  # the virtual node before every source
ALPHA = 0.5  # the score's exponent on the share of compute nodes (the paper's default)


@dataclass(frozen=True)
class Dag:
    """Nodes 0..n-1 in a topological order, their predecessor and successor lists."""

    preds: tuple[tuple[int, ...], ...]
    succs: tuple[tuple[int, ...], ...]

    @property
    def n(self) -> int:
        return len(self.preds)

    @staticmethod
    def of(n: int, edges: Sequence[tuple[int, int]]) -> Dag:
        preds: list[set[int]] = [set() for _ in range(n)]
        succs: list[set[int]] = [set() for _ in range(n)]
        for a, b in edges:
            if a != b:
                preds[b].add(a)
                succs[a].add(b)
        return Dag(tuple(tuple(sorted(p)) for p in preds), tuple(tuple(sorted(s)) for s in succs))


def dominators(dag: Dag) -> list[int]:
    """Immediate dominator of each node (ROOT for sources or nodes reached from several sources): one pass in
    topological order, the dominator-tree LCA of the predecessors."""
    idom = [ROOT] * dag.n
    depth = [0] * dag.n

    def lca(a: int, b: int) -> int:
        while a != b:
            if a == ROOT or b == ROOT:
                return ROOT
            if depth[a] >= depth[b]:
                a = idom[a]
            else:
                b = idom[b]
        return a

    for x in range(dag.n):
        ps = dag.preds[x]
        if not ps:
            continue
        h = ps[0]
        for p in ps[1:]:
            h = lca(h, p)
            if h == ROOT:
                break
        idom[x] = h
        depth[x] = depth[h] + 1 if h != ROOT else 1
    return idom


def candidate(dag: Dag, x: int, head: int, limit: int) -> frozenset[int] | None:
    """Every node on a path from `head` (excluded) to x (included), or None beyond `limit` nodes."""
    seen = {x}
    stack = [x]
    while stack:
        u = stack.pop()
        for p in dag.preds[u]:
            if p != head and p not in seen:
                seen.add(p)
                if len(seen) > limit:
                    return None
                stack.append(p)
    return frozenset(seen)


def group_level(dag: Dag, score: Callable[[frozenset[int]], float], max_size: int, target: int) -> list[frozenset[int]]:
    """One level of H-Partition: candidates from every node and its dominator (with and without the node
    itself, and with the dominator where that keeps Property 1), the lowest score grouped first, the candidates it meets grown to include it (dropped past
    `max_size` nodes), until at most `target` groups and ungrouped nodes remain or no candidate is left.
    Returns the groups, ungrouped nodes as singletons, ordered by their first node."""
    idom = dominators(dag)
    cands: dict[int, frozenset[int]] = {}
    seen: set[frozenset[int]] = set()
    for x in range(dag.n):
        if not dag.preds[x]:
            continue
        h = idom[x]
        c = candidate(dag, x, h, max_size)
        if c is None:
            continue
        # with the head too when the head has at most one predecessor (the group's head is then that one)
        with_head = c | {h} if h != ROOT and len(dag.preds[h]) <= 1 and len(c) < max_size else c
        for variant in (c, c - {x}, with_head):
            if len(variant) >= 2 and variant not in seen:
                seen.add(variant)
                cands[len(cands)] = variant
    group_of = list(range(dag.n))  # node -> group id (a node's own id while ungrouped)
    members: dict[int, frozenset[int]] = {i: frozenset((i,)) for i in range(dag.n)}
    by_node: dict[int, set[int]] = {}
    for cid, c in cands.items():
        for u in c:
            by_node.setdefault(u, set()).add(cid)
    version = dict.fromkeys(cands, 0)
    heap = [(score(c), min(c), cid, 0) for cid, c in cands.items()]
    heapq.heapify(heap)
    count = dag.n
    while heap and count > target:
        _, _, cid, ver = heapq.heappop(heap)
        if cid not in cands or version[cid] != ver:
            continue
        c = cands.pop(cid)
        for u in c:
            by_node[u].discard(cid)
        old = {group_of[u] for u in c}
        if len(old) < 2:
            continue  # already one group
        gid = min(old)
        for g in old:
            members.pop(g)
        members[gid] = c
        for u in c:
            group_of[u] = gid
        count -= len(old) - 1
        touched = {k for u in c for k in by_node.get(u, ())}
        for k in touched:
            grown = cands[k] | c
            for u in grown - cands[k]:
                by_node.setdefault(u, set()).add(k)
            if len(grown) > max_size or len({group_of[u] for u in grown}) < 2:
                for u in grown:
                    by_node[u].discard(k)
                del cands[k]
                continue
            cands[k] = grown
            version[k] += 1
            heapq.heappush(heap, (score(grown), min(grown), k, version[k]))
    groups = sorted(members.values(), key=min)
    if len(groups) > target:
        groups = merge_neighbours(dag, groups, score, max_size, target)
    return groups


def merge_neighbours(
    dag: Dag, groups: list[frozenset[int]], score: Callable[[frozenset[int]], float], max_size: int, target: int
) -> list[frozenset[int]]:
    """When the dominator candidates leave too many groups (wide DAGs, where most nodes' dominator is the root):
    merge neighbours in a topological order of the groups, the pair of lowest score first, within `max_size`.
    Consecutive groups of a topological order are convex together: a path between them cannot leave the run."""
    _, order = contract(dag, groups)
    items: list[frozenset[int] | None] = list(order)
    nxt = list(range(1, len(items))) + [-1]
    prv = [-1] + list(range(len(items) - 1))
    heap = []

    def push(i: int) -> None:
        j = nxt[i]
        if j >= 0 and items[i] is not None and items[j] is not None:
            u = items[i] | items[j]  # type: ignore[operator]
            if len(u) <= max_size:
                heapq.heappush(heap, (score(u), min(u), i, j))

    for i in range(len(items)):
        push(i)
    count = len(items)
    while heap and count > target:
        _, _, i, j = heapq.heappop(heap)
        if items[i] is None or items[j] is None or nxt[i] != j:
            continue
        if len(items[i]) + len(items[j]) > max_size:  # type: ignore[arg-type]
            continue  # an entry from before one of the two grew
        items[i] = items[i] | items[j]  # type: ignore[operator]
        items[j] = None
        nxt[i] = nxt[j]
        if nxt[j] >= 0:
            prv[nxt[j]] = i
        count -= 1
        push(i)
        if prv[i] >= 0:
            push(prv[i])
    return sorted((g for g in items if g is not None), key=min)


def contract(dag: Dag, groups: Sequence[frozenset[int]]) -> tuple[Dag, list[frozenset[int]]]:
    """The DAG of the groups (each group one node), its nodes in a deterministic topological order, and the
    groups in that order."""
    of = {u: k for k, g in enumerate(groups) for u in g}
    edges = {(of[a], of[b]) for a in range(dag.n) for b in dag.succs[a] if of[a] != of[b]}
    order = topological_order(range(len(groups)), edges, key=lambda k: min(groups[k]))
    pos = {k: i for i, k in enumerate(order)}
    return Dag.of(len(order), [(pos[a], pos[b]) for a, b in edges]), [groups[k] for k in order]


def is_convex(dag: Dag, group: frozenset[int]) -> bool:
    """No path leaves the group and comes back (Definition A.1)."""
    outside = {s for u in group for s in dag.succs[u] if s not in group}
    seen = set(outside)
    stack = list(outside)
    while stack:
        u = stack.pop()
        for s in dag.succs[u]:
            if s in group:
                return False
            if s not in seen:
                seen.add(s)
                stack.append(s)
    return True
