"""The crossing bound: what one device must hold while the last of its heaviest ops runs (a min cut per op)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from xsched.contracts.graph import Graph

CAP_UNITS = 2**30  # value sizes are floored to units that keep every capacity sum inside scipy's int32 flows
INF = 2**31 - 1
MAX_FLOWS = 1000  # about a second of min cuts; the sets searched by then stand


@dataclass(frozen=True)
class Crossing:
    """At least `bytes` (beyond the homed inputs) are held while `op`, one of the `heavy` ops needing at least
    `need` bytes, runs for the last time among them."""

    bytes: int
    op: str
    heavy: int
    need: int


class _Network:
    """The graph as a flow network: op nodes, each value split into an in and an out node joined by an arc of
    its size (holding it), and a sink behind every value that must be resident at the end."""

    def __init__(self, graph: Graph, homes: Mapping[str, str], device: str, ends: set[str]) -> None:
        import numpy as np  # here: scipy's import takes most of a second, and only one-device bounds need it

        self.graph = graph
        total = sum(v.nbytes for v in graph.values)
        self.unit = max(1, -(-total // CAP_UNITS))
        n_ops, n_vals = len(graph.ops), len(graph.values)
        self.val_index = {v.id: i for i, v in enumerate(graph.values)}
        self.source, self.sink = n_ops + 2 * n_vals, n_ops + 2 * n_vals + 1
        self.n = n_ops + 2 * n_vals + 2
        self.cap = np.array(
            [0 if homes.get(v.id) == device else v.nbytes // self.unit for v in graph.values], dtype=np.int64
        )
        arcs: set[tuple[int, int]] = set()
        for i, op in enumerate(graph.ops):
            arcs |= {(i, self._in(u)) for u in op.outputs} | {(self._out(u), i) for u in op.inputs}
        arcs |= {(self._out(v), self.sink) for v in ends}
        arcs |= {(self._in(v.id), self._out(v.id)) for v in graph.values}  # holding v: capacity set per cut
        self.rows, self.cols = (list(side) for side in zip(*sorted(arcs), strict=True))
        self.holding = np.array([r >= n_ops and (r - n_ops) % 2 == 0 for r in self.rows])  # the in -> out arcs
        self.value_of_arc = (np.array(self.rows)[self.holding] - n_ops) // 2

    def _in(self, v: str) -> int:
        return len(self.graph.ops) + 2 * self.val_index[v]

    def _out(self, v: str) -> int:
        return self._in(v) + 1

    def cut(self, sources: list[int], free: set[str]) -> int:
        """Least bytes of values (beyond `free` and the homed ones) whose holding separates every path from an
        op in `sources` to a value that must end resident; floored to whole units, so never above the true cut."""
        import numpy as np
        from scipy.sparse import csr_matrix
        from scipy.sparse.csgraph import maximum_flow

        cap = self.cap.copy()
        cap[[self.val_index[v] for v in free]] = 0
        data = np.full(len(self.rows), INF, dtype=np.int64)
        data[self.holding] = cap[self.value_of_arc]
        rows, cols = self.rows + [self.source] * len(sources), self.cols + sources
        data = np.concatenate([data, np.full(len(sources), INF, dtype=np.int64)]).astype(np.int32)
        matrix = csr_matrix((data, (rows, cols)), shape=(self.n, self.n))
        return int(maximum_flow(matrix, self.source, self.sink).flow_value) * self.unit


def crossing_bound(
    graph: Graph, need: Mapping[str, int], device: str, homes: Mapping[str, str], ends: set[str], beat: int
) -> Crossing | None:
    """The largest crossing bound over need thresholds, if it beats `beat` bytes; for a plan on this device alone.

    Take any set A of ops (every op runs at least once) and a* the one whose last run comes last. While a* runs,
    the device holds a*'s need, and for every value that must end resident, either that value or, on every path
    to it from an op of A, some value made at or before then and read after (no op of A runs later to make it
    again, and no copy can bring it). So it holds a*'s need plus a cut between A and the end values, in which a*'s
    own inputs and outputs are free. The bound is the least, over a* in A, of that sum. A is the ops needing at
    least some threshold; the thresholds are tried from the largest need down, each stopping early once it
    cannot beat the best so far. `need`: op id -> its bytes beyond the homed inputs (`bounds.op_need`)."""
    network = _Network(graph, homes, device, ends)
    end_bytes = sum(graph.value[v].nbytes for v in ends if homes.get(v) != device)
    cut_at_least = dict.fromkeys(need, 0)  # an op's cut only grows as the set A grows
    best: Crossing | None = None
    flows = 0
    for threshold in sorted(set(need.values()), reverse=True):
        if threshold + end_bytes <= beat:  # every a* of this set or a larger one needs at most this much
            break
        heavy = sorted((op.id for op in graph.ops if need[op.id] >= threshold), key=lambda o: need[o] + cut_at_least[o])
        sources = [graph.op_index[o] for o in heavy]
        least: tuple[int, str] | None = None
        for o in heavy:
            if least is not None and (need[o] + cut_at_least[o] >= least[0] or least[0] <= beat):
                break
            if flows == MAX_FLOWS:
                return best  # this set's least is unknown; the sets done so far stand
            flows += 1
            op = graph.op[o]
            cut_at_least[o] = network.cut(sources, set(op.inputs) | set(op.outputs))
            if least is None or need[o] + cut_at_least[o] < least[0]:
                least = (need[o] + cut_at_least[o], o)
        if least is not None and least[0] > beat:
            beat = least[0]
            best = Crossing(least[0], least[1], len(heavy), threshold)
    return best
