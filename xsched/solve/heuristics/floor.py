"""A cheap lower bound on a one-device compute order's peak (the checkpoint search skips planning candidates
that cannot fit)."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

from xsched.contracts.graph import Graph
from xsched.contracts.plan import Compute


def resident_floor(
    graph: Graph,
    computes: Sequence[Compute],
    device: str,
    homes: Mapping[str, str],
    remade: Collection[str] = (),
) -> int:
    """A lower bound on the peak on `device` of the routed plan of one-device `computes`, without routing or
    simulating it: at each compute, the inputs homed there, the values made before it and read at or after it (or
    kept as graph outputs from their last making), and its outputs (what the interpreter counts while it runs).
    `remade`: graph outputs that computes appended later may make again, so not counted as kept: the floor then
    bounds every such extension's peak too (reads appended later only hold values longer)."""
    n = len(computes)
    nbytes = {v.id: v.nbytes for v in graph.values}
    made: dict[str, list[int]] = {}  # value -> where it is made, in order
    reads: dict[str, list[int]] = {}
    for i, c in enumerate(computes):
        op = graph.op[c.op]
        for v in op.inputs:
            reads.setdefault(v, []).append(i)
        for v in op.outputs:
            made.setdefault(v, []).append(i)
    outputs = set(graph.outputs) - set(remade)
    delta = [0] * (n + 1)  # held just before compute i: bytes over (made, last read before the next making]
    for v, at in made.items():
        rs, k = reads.get(v, []), 0
        for j, p in enumerate(at):
            nxt = at[j + 1] if j + 1 < len(at) else n
            last = p
            while k < len(rs) and rs[k] <= nxt:  # a read at the next making reads the value made here
                last = max(last, rs[k]) if rs[k] > p else last
                k += 1
            if v in outputs and j + 1 == len(at):
                last = n - 1
            if last > p:
                delta[p + 1] += nbytes[v]
                delta[last + 1] -= nbytes[v]
    homed = sum(nbytes[v] for v, d in homes.items() if d == device)
    floor, held = homed, 0
    for i, c in enumerate(computes):
        held += delta[i]
        op = graph.op[c.op]
        away = sum(nbytes[v] for v in set(op.inputs) if v not in made and homes.get(v) != device)  # copied in
        floor = max(floor, homed + held + away + sum(nbytes[v] for v in op.outputs))
    return floor
