"""Fusion-aware checkpointing by minimum cut: save at the cut, recompute fusible chains inside their consumers.

The formulation of the min-cut partitioner behind torch.compile (fusion-aware checkpointing, docs/papers),
on a training graph's values. Forward values are those computable without a tangent. Backward needs some of them;
each is either saved (kept from forward) or recomputed in backward from saved values. Recomputing is allowed only
through fusible ops (`xsched.profiling.fused`: pointwise, layer norm, views), whose recomputation a fusing
compiler does inside the consumer's kernel at no kernel of its own. Saving v costs its bytes once read back by
backward, twice when forward would not have written it otherwise (it and all its readers are fusible: it would
live only in registers). An s-t cut over in/out vertices per value prices each choice; its minimum is the cheapest
valid set of saved values (the paper's Theorem 3.6), found by max-flow (networkx).

The plan: forward in graph order, freeing what is not saved after its last forward read; backward in graph order,
each op preceded by the recomputation of the forward values it reads and no longer holds (the chain that a
compiled region fuses into it). When that misses the budget, a second cut also lets non-fusible ops be recomputed
(pure memory: each value at its bytes). The plan's times are the profile's: price it with
`profiling.fused.fused_profile` to see the recomputed chains as compiled.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence

from xsched.contracts.graph import Graph
from xsched.contracts.plan import Compute, Plan
from xsched.contracts.result import HeuristicStats
from xsched.errors import BudgetError
from xsched.profiling.fused import fusible
from xsched.solve.heuristics.routing import finish_with_early_homes, route
from xsched.solve.options import SolverOptions
from xsched.solve.problem import Problem

INF = float("inf")


def forward_values(graph: Graph) -> set[str]:
    """Values computable from the graph inputs without a tangent (graph inputs other than tangents included)."""
    out = {v for v in graph.inputs if graph.value[v].kind != "tangent"}
    for op in graph.ops:
        if all(v in out for v in op.inputs):
            out.update(op.outputs)
    return out


def needs(graph: Graph, fwd: set[str]) -> set[str]:
    """Forward values backward reads (the inputs of ops that are not forward) and forward graph outputs."""
    out = {v for op in graph.ops if not set(op.outputs) <= fwd for v in op.inputs if v in fwd}
    return out | {v for v in graph.outputs if v in fwd}


def banned(graph: Graph, v: str) -> bool:
    """A value that may not be recomputed: a graph input, or made by an op no compiler fuses into its reader."""
    p = graph.producer.get(v)
    return p is None or not fusible(graph.op[p])


def materialised(graph: Graph, v: str, fwd: set[str]) -> bool:
    """Forward writes v to memory whatever is saved: an input, a graph output, or it or a reader is not fusible."""
    p = graph.producer.get(v)
    if p is None or v in graph.outputs or not fusible(graph.op[p]):
        return True
    return any(not fusible(o) for o in graph.ops if v in o.inputs and set(o.outputs) <= fwd)


def save_cost(graph: Graph, v: str, fwd: set[str]) -> int:
    """Bytes moved by saving v: read back by backward, and written by forward when it would not be otherwise. A graph
    input is resident for the whole plan whatever is saved: it costs nothing here."""
    if v not in graph.producer:
        return 0
    w = graph.value[v].nbytes
    return w if materialised(graph, v, fwd) else 2 * w


def min_cut(
    graph: Graph,
    cost: Callable[[str], float] | None = None,
    ban: Callable[[str], bool] | None = None,
) -> tuple[set[str], float]:
    """The saved forward values of least total `cost` (default save_cost) such that backward can recompute every
    forward value it needs from them, never recomputing a value `ban` (default `banned`) marks; and that cost."""
    import networkx as nx

    fwd = forward_values(graph)
    need = needs(graph, fwd)
    cost = cost or (lambda v: save_cost(graph, v, fwd))
    ban = ban or (lambda v: banned(graph, v))
    g = nx.DiGraph()
    for v in fwd:
        g.add_edge(("in", v), ("out", v), capacity=cost(v))
        if ban(v):  # kept in the source side: saved, or not needed at all
            g.add_edge("s", ("in", v))
        if v in need:  # backward reads it: the sink side must be reached only through a cut in-out edge
            g.add_edge(("out", v), "t")
    for op in graph.ops:
        if set(op.outputs) <= fwd:
            for u in op.inputs:
                for v in op.outputs:
                    g.add_edge(("out", u), ("in", v))  # recomputing v needs u: u saved or recomputed too
    if "s" not in g or "t" not in g:
        return set(), 0.0
    value, (side, _) = nx.minimum_cut(g, "s", "t")  # edges without capacity are infinite
    saved = {v for v in fwd if ("in", v) in side and ("out", v) not in side}
    return saved, float(value)


def schedule(graph: Graph, saved: set[str], device: str) -> list[Compute]:
    """Forward in graph order; then each backward op after recomputing the forward values it reads that are neither
    saved nor still held, deepest first (the chain a compiled region fuses into it)."""
    fwd = forward_values(graph)
    computes = [Compute(op.id, device) for op in graph.ops if set(op.outputs) <= fwd]
    held = set(saved) | {v for v in graph.inputs}
    made: set[str] = set()  # recomputed in backward and still held (place_frees frees them after their last read)

    def ensure(v: str) -> None:
        if v in held or v in made:
            return
        op = graph.op[graph.producer[v]]
        for u in op.inputs:
            ensure(u)
        computes.append(Compute(op.id, device))
        made.update(op.outputs)

    for op in graph.ops:
        if set(op.outputs) <= fwd:
            continue
        for v in op.inputs:
            if v in fwd:
                ensure(v)
        computes.append(Compute(op.id, device))
    for v in graph.outputs:
        if v in fwd:
            ensure(v)
    return computes


def fused_cut_plan(
    graph: Graph,
    profile: object,
    budgets: Mapping[str, int],
    device: str,
    homes: Mapping[str, str],
    via: Sequence[str] = (),
) -> Plan:
    """The min-cut plan on `device`; over its budget, the memory cut (any op recomputable, each value at its bytes).
    `via`: the devices a copy may pass through (route)."""
    t0 = time.perf_counter()
    errors: list[BudgetError] = []
    variants = [
        ("fusible recompute", None, None),
        (
            "memory cut",
            lambda v: float(graph.value[v].nbytes * (v in graph.producer)),
            lambda v: v not in graph.producer,
        ),
    ]
    for variant, cost, ban in variants:
        saved, value = min_cut(graph, cost, ban)
        steps = route(graph, schedule(graph, saved, device), homes, profile, via=via)  # type: ignore[arg-type]
        try:
            stats = HeuristicStats(device=device, variant=variant)
            return finish_with_early_homes(
                graph,
                steps,
                "fused-cut",
                budgets,
                homes,
                profile,
                t0,
                stats=stats,  # type: ignore[arg-type]
            )
        except BudgetError as e:
            errors.append(e)
    raise errors[-1]


def run(problem: Problem, options: SolverOptions, warm: Plan | None) -> Plan:
    """Registry entry (through registry.from_plan): one computing device, the warm start unused."""
    computing = problem.computing
    if len(computing) != 1:
        raise BudgetError("fused-cut plans one computing device", stage="solve")
    graph, profile, budgets, homes = problem.graph, problem.profile, problem.budgets, problem.homes
    return fused_cut_plan(graph, profile, budgets, computing[0], homes, problem.devices)
