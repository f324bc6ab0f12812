"""DTR-style eviction under a byte budget (Kirisame et al. 2021): graph order, evicting the held value that is cheapest
to make again per byte and distance and recomputing it on demand; the `checkpoint` search's fallback and an order
`offload` and hier's bottom blocks reuse."""

from __future__ import annotations

from xsched.budgets import format_bytes
from xsched.contracts.graph import Graph
from xsched.contracts.holds import pinned_holds
from xsched.contracts.plan import Compute
from xsched.contracts.profile import Profile
from xsched.errors import BudgetError
from xsched.solve.autograd_boundary import forward_outputs
from xsched.solve.heuristics.routing import op_workspace
from xsched.solve.heuristics.timeline import Resident, op_seconds

REDO_DEPTH = 32  # levels of missing ancestors in a recompute's cost estimate (DTR's e*, kept shallow)
MAX_EVICTIONS = 4  # per op of the graph: past this the eviction search gives up (it thrashes on tight budgets)


def evict_computes(
    graph: Graph, device: str, budget: int, profile: Profile | None = None, evict_outputs: bool = False
) -> list[Compute]:
    """Graph order under a byte budget, evicting and recomputing on demand (in the spirit of DTR,
    Kirisame et al. 2021): when an op does not fit, evict the held value with the lowest
    recompute time / (bytes x distance to its next use), and recompute evicted values, and their
    missing ancestors, when they are needed again. Works on any DAG, not only fwd/bwd graphs.

    The tracker holds every value until its last consumer or its eviction and every graph input
    from the start, so the routed plan (frees after last reads) never needs more than it saw.
    What the ops waiting on the recompute stack hold is never evicted, so nothing is recomputed in circles.
    Graph outputs are held from when they are made; with `evict_outputs`, a value the wrapped forward returns may
    be evicted once backward ops have read it and is recomputed at the end, from whatever is held then (leaner
    where the memory that recompute needs is free at the end; a GPT's logits need more than is left there).
    """
    cost = op_seconds(graph, device, profile)
    end = len(graph.ops)  # the graph outputs' last read, after every op
    # with evict_outputs, the values the wrapped forward returns may be evicted once backward ops have read them
    # (the boundary rule holds them until backward starts) and are recomputed at the end; gradients and buffer
    # updates stay (recomputing one redoes a chain at the end for a few bytes)
    # (never those the caller holds through backward: evicting one frees nothing)
    late = (set(forward_outputs(graph)) & set(graph.outputs)) - set(pinned_holds(graph)) if evict_outputs else set()
    # re-making a producer at the end re-makes all its outputs, so each must have been read in backward first
    siblings = {v: [u for u in graph.op[graph.producer[v]].outputs if u in late] for v in late}
    read_in_bwd: set[str] = set()
    on = Resident(graph, device, fixed=set(graph.inputs) | (set(graph.outputs) - late) | set(pinned_holds(graph)))
    nbytes, held, uses = on.nbytes, on.held, on.ahead  # the same objects, updated by `on`
    for v in late:
        uses[v].insert(0, end)  # read again at the end
    out: list[Compute] = []
    order = {v.id: k for k, v in enumerate(graph.values)}  # ties broken in graph order, not set order
    evictions, max_evictions = 0, MAX_EVICTIONS * len(graph.ops)

    def redo_cost(v: str, memo: dict[str, float], depth: int = 0) -> float:
        """Time to recompute v: its producer plus, recursively, its missing ancestors (DTR's e*).
        An estimate: past REDO_DEPTH levels only the producer counts, which keeps the recursion shallow."""
        if v not in memo:
            p = graph.op[graph.producer[v]]
            missing = [u for u in p.inputs if u not in held] if depth < REDO_DEPTH else []
            memo[v] = cost[p.id] + sum(redo_cost(u, memo, depth + 1) for u in missing)
        return memo[v]

    def evict_score(v: str, now: int, memo: dict[str, float]) -> float:
        """Lowest goes first: cheap to redo, big, and needed late; values no later op reads go first of all."""
        return redo_cost(v, memo) / (nbytes[v] * (uses[v][-1] - now + 1)) if uses[v] else -1.0

    ends = [graph.producer[v] for v in graph.outputs if v in late]  # after the last op: the evicted ones again
    for i, root in enumerate([*(o.id for o in graph.ops), *ends]):
        at_end = i >= end
        if at_end and all(v in held for v in graph.op[root].outputs if v in late):
            continue
        stack = [root]
        while stack:
            op = graph.op[stack[-1]]
            if (len(stack) > 1 or at_end) and all(v in held for v in op.outputs):
                stack.pop()  # pushed twice for the same missing value: already recomputed
                continue
            missing = [graph.producer[v] for v in op.inputs if v not in held]
            if missing:
                stack.extend(dict.fromkeys(missing))
                continue
            need = sum(nbytes[v] for v in op.outputs) + op_workspace(op, device, profile)
            pinned = {v for x in stack for v in (*graph.op[x].inputs, *graph.op[x].outputs)}
            if at_end:
                pinned |= late  # the end reads them all: one restored is not evicted for the next
            while on.used + need > budget:
                victims = [
                    v
                    for v in held - pinned - on.fixed
                    if nbytes[v] > 0 and (v not in late or all(u in read_in_bwd for u in siblings[v]))
                ]
                if not victims:
                    raise BudgetError(
                        f"eviction cannot fit op {op.id} in {format_bytes(budget)} on {device}: "
                        f"{format_bytes(on.used)} held by its inputs and fixed values, "
                        f"{format_bytes(need)} more needed",
                        stage="solve",
                        op=op.id,
                        device=device,
                    )
                if evictions >= max_evictions:
                    raise BudgetError(
                        f"eviction gave up at op {op.id} after {evictions} evictions on {device} "
                        f"(budget {format_bytes(budget)})",
                        stage="solve",
                        op=op.id,
                        device=device,
                    )
                now = min(i, end)
                v = min(victims, key=lambda v, now=now, memo={}: (evict_score(v, now, memo), order[v]))
                evictions += 1
                on.evict(v)
            out.append(Compute(op.id, device))
            if op.phase == "bwd":
                read_in_bwd.update(v for v in op.inputs if v in late)
            on.hold(op.outputs)
            stack.pop()
        if not at_end:
            on.release(graph.op[root], i)
    return out
