"""The hierarchy of blocks: H-Partition applied to the forward graph level by level, each block's forward ops and
the backward ops that differentiate them (HiREmate's layers: F_j and B_j), leaves solved flat, the rest by H-ILP."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

from xsched.contracts.graph import Graph
from xsched.solve.hier.partition import ALPHA, Dag, contract, group_level

MAX_LEAF = 24  # forward ops in a bottom block (its subproblem, with the backward ops, stays small for the MILP)
MAX_GROUP = 8  # blocks in a block of a higher level
MAX_TOP = 16  # blocks at the top (its H-ILP has twice as many stages: forward and backward)


@dataclass(frozen=True)
class Block:
    """A convex set of forward ops (`f_ops`, graph order) and the backward ops assigned to them (`b_ops`).
    `children` are the blocks it is made of (none for a leaf, solved by the flat solvers); `level` 0 is one op."""

    f_ops: tuple[str, ...]
    b_ops: tuple[str, ...]
    children: tuple[Block, ...] = ()
    level: int = 0

    @property
    def ops(self) -> tuple[str, ...]:
        return self.f_ops + self.b_ops

    @property
    def leaf(self) -> bool:
        return not self.children

    def walk(self) -> list[Block]:
        """Every block below and including this one, children before parents."""
        out: list[Block] = []
        for c in self.children:
            out += c.walk()
        return out + [self]


@dataclass(frozen=True)
class Hierarchy:
    top: Block
    layered: bool  # forward/backward split (training graph) rather than one set of ops per block
    levels: int

    @cached_property
    def blocks(self) -> list[Block]:
        return self.top.walk()


def layered(graph: Graph) -> bool:
    """A training graph whose forward (and loss) ops read nothing a backward op makes: blocks pair the two."""
    bwd = {v for o in graph.ops if o.phase == "bwd" for v in o.outputs}
    fwd = [o for o in graph.ops if o.phase != "bwd"]
    return bool(bwd) and bool(fwd) and not any(v in bwd for o in fwd for v in o.inputs)


def build_hierarchy(
    graph: Graph, max_leaf: int = MAX_LEAF, max_group: int = MAX_GROUP, max_top: int = MAX_TOP
) -> Hierarchy:
    """Partition the forward ops (every op of a graph without a backward) into convex blocks of at most `max_leaf`
    ops, then blocks of at most `max_group` blocks, until at most `max_top` remain; then give each block the
    backward ops of its forward ops."""
    split = layered(graph)
    atoms = [o.id for o in graph.ops if not split or o.phase != "bwd"]
    index = {a: i for i, a in enumerate(atoms)}
    readers: dict[str, set[int]] = {}
    for a in atoms:
        for v in graph.op[a].inputs:
            if v in graph.producer and graph.producer[v] in index:
                readers.setdefault(v, set()).add(index[a])
    edges = [(index[graph.producer[v]], r) for v, rs in readers.items() for r in rs]
    data_in = {v.id for v in graph.values if v.kind in ("input", "tangent")}
    anchored = {i for i, a in enumerate(atoms) if data_in.intersection(graph.op[a].inputs)}
    clusters = _clusters(len(atoms), edges, anchored)
    dag, clusters = contract(Dag.of(len(atoms), edges), clusters)
    nodes: list[frozenset[int]] = list(clusters)  # atoms of each current node
    blocks: list[Block] = [Block(tuple(atoms[a] for a in sorted(c)), ()) for c in clusters]
    levels = 0
    limit = max_leaf
    if not split:  # no phantoms to trade: one level of small blocks, so their recomputes stay small (cones)
        max_top = max(max_top, -(-len(nodes) // max_leaf))
    while len(nodes) > max_top:
        score = _scorer(graph, atoms, nodes, readers)
        groups = group_level(dag, score, limit, max_top)
        if len(groups) == len(nodes):
            break  # no candidate fits: the top stays bigger than max_top
        levels += 1
        dag, groups = contract(dag, groups)
        nodes = [frozenset(a for k in g for a in nodes[k]) for g in groups]
        blocks = [_merge([blocks[k] for k in sorted(g)], levels) for g in groups]
        limit = max_group
    order = [a for b in blocks for a in b.f_ops]  # nested topological order of the forward ops
    return Hierarchy(_assign(graph, blocks, order, split), split, levels + 1)


def _clusters(n: int, edges: Sequence[tuple[int, int]], anchored: set[int]) -> list[frozenset[int]]:
    """Each source that reads no data input (an op reading only params or buffers, e.g. a running-statistics
    update's scaling of the buffer; `anchored` ops read the model's inputs and stay apart) with the earliest op it
    feeds: alone it would be a second entry into every group around that op, which no
    candidate could then contain (its dominator is the root). The pair is convex: nothing before the reader
    can lie on a path from the source to it. An op with no edges at all joins the next op that has some."""
    preds: dict[int, list[int]] = {}
    first: dict[int, int] = {}
    for a, b in edges:
        preds.setdefault(b, []).append(a)
        first[a] = min(first.get(a, b), b)
    owner = list(range(n))
    linked = [a for a in range(n) if a in preds or a in first]
    for a in range(n):
        if a in anchored:
            continue
        if a not in preds and a in first:
            owner[a] = first[a]
        elif a not in preds and linked:  # isolated (a counter update): any neighbour keeps groups convex
            owner[a] = next((b for b in linked if b > a), linked[-1])
    for a in range(n):  # a reader that is itself a source follows its own reader
        while owner[owner[a]] != owner[a]:
            owner[a] = owner[owner[a]]
    groups: dict[int, set[int]] = {}
    for a in range(n):
        groups.setdefault(owner[a], set()).add(a)
    return [frozenset(g) for g in groups.values()]


def _merge(members: Sequence[Block], level: int) -> Block:
    if len(members) == 1:
        return members[0]
    f_ops = tuple(a for m in members for a in m.f_ops)
    if all(m.leaf for m in members) and level == 1:
        return Block(f_ops, (), (), 1)  # a bottom block: solved flat as a whole
    return Block(f_ops, (), tuple(members), level)


def _scorer(graph: Graph, atoms: Sequence[str], nodes: Sequence[frozenset[int]], readers: dict[str, set[int]]):
    """The score of a candidate (a set of current nodes): the bytes of the values crossing its boundary times
    (its nodes / its nodes and the values they pass on)^alpha (eq. 1). Graph inputs (params) are not counted."""
    node_of = {a: k for k, atom_set in enumerate(nodes) for a in atom_set}
    produced = [[v for a in ns for v in graph.op[atoms[a]].outputs] for ns in nodes]
    read = [[v for a in ns for v in graph.op[atoms[a]].inputs if v in graph.producer] for ns in nodes]
    outputs = set(graph.outputs)
    size = {v.id: v.nbytes for v in graph.values}
    passed = [
        {v for v in produced[k] if v in outputs or any(node_of[r] != k for r in readers.get(v, ()))}
        for k in range(len(nodes))
    ]

    def score(cand: frozenset[int]) -> float:
        made = {v for k in cand for v in produced[k]}
        ins = {v for k in cand for v in read[k]} - made
        outs = {v for v in made if v in outputs or any(node_of[r] not in cand for r in readers.get(v, ()))}
        data = {v for k in cand for v in passed[k]}
        boundary = sum(size[v] for v in ins | outs)
        return boundary * (len(cand) / (len(cand) + len(data))) ** ALPHA

    return score


def _assign(graph: Graph, blocks: Sequence[Block], order: Sequence[str], split: bool) -> Block:
    """Each backward op goes to the forward op of the highest position (in `order`) among those making its inputs,
    lowered to the positions of the backward ops feeding it, so positions never rise along a backward edge: each
    block's backward ops are then convex and blocks' backward parts run in reverse order of their forward parts."""
    pos = {a: i for i, a in enumerate(order)}
    last = len(order) - 1
    at: dict[str, int] = {}
    if split:
        for o in graph.ops:
            if o.phase != "bwd":
                continue
            makers = [graph.producer[v] for v in o.inputs if v in graph.producer]
            p = max((pos[m] for m in makers if m in pos), default=last)
            p = min([p, *(at[m] for m in makers if m in at)])
            at[o.id] = p
    by_pos: dict[int, list[str]] = {}
    for o, p in at.items():
        by_pos.setdefault(p, []).append(o)
    rank = graph.op_index

    def fill(b: Block, lo: int) -> tuple[Block, int]:
        if b.leaf:
            hi = lo + len(b.f_ops)
            mine = sorted((o for p in range(lo, hi) for o in by_pos.get(p, ())), key=rank.__getitem__)
            return Block(b.f_ops, tuple(mine), (), b.level), hi
        kids, at_ = [], lo
        for c in b.children:
            k, at_ = fill(c, at_)
            kids.append(k)
        return Block(
            b.f_ops, tuple(sorted((o for k in kids for o in k.b_ops), key=rank.__getitem__)), tuple(kids), b.level
        ), at_

    top = Block(tuple(order), (), tuple(blocks), max((b.level for b in blocks), default=0) + 1)
    filled, _ = fill(top, 0)
    return filled
