"""The order as a decision: memory-aware starting orders (graph order, greedy least-growth, depth-first, a warm
plan's), then local moves that keep the order topological, each scored by the fixed-order interval solver."""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace

from xsched.contracts.graph import Graph
from xsched.contracts.plan import Compute, Plan, place_frees
from xsched.contracts.result import OrderSearchStats, SolveResult, Times
from xsched.errors import XschedError
from xsched.solve.objective import better, objective
from xsched.solve.options import SolverOptions
from xsched.solve.problem import Outcome, Problem

Scorer = Callable[[tuple[int, ...], float], "Plan | None"]  # (order, seconds) -> the solver's plan, None: none
# the local search stops after this many draws of moves in a row that were all scored already: the best order's
# neighbourhood is then (almost surely) exhausted, which happens on small graphs long before the time limit
STALE_DRAWS = 50


def topological(graph: Graph, order: Sequence[int]) -> bool:
    """Every op after the producers of its inputs, each op once."""
    if sorted(order) != list(range(len(graph.ops))):
        return False
    pos = {i: q for q, i in enumerate(order)}
    idx = graph.op_index
    return all(
        pos[idx[graph.producer[v]]] < pos[i] for i, op in enumerate(graph.ops) for v in op.inputs if v in graph.producer
    )


def single_order(graph: Graph) -> bool:
    """Graph order is the graph's only topological order (each op reads an output of the op before it), so every
    plan's first computes follow it."""
    ops = graph.ops
    return all(any(graph.producer.get(v) == ops[i - 1].id for v in ops[i].inputs) for i in range(1, len(ops)))


def stage_proof_covers_every_plan(problem: Problem) -> bool:
    """Where an exact model's proof of optimality holds for every plan, not only for those it can express: one device
    (above it the stage objective counts each stage to its end, over-estimating plans that overlap across stages) and
    graph order the only order (else a plan whose first computes leave graph order is outside the stage model)."""
    return len(problem.devices) == 1 and single_order(problem.graph)


def eager_peak_of(graph: Graph, order: Sequence[int]) -> int:
    """Peak bytes of running `order` once with every value freed after its last read (graph inputs kept)."""
    size = {v.id: v.nbytes for v in graph.values}
    left = {v.id: 0 for v in graph.values}
    for op in graph.ops:
        for v in dict.fromkeys(op.inputs):
            left[v] += 1
    outputs, inputs = set(graph.outputs), set(graph.inputs)
    used = peak = sum(size[v] for v in inputs)
    for i in order:
        op = graph.ops[i]
        used += sum(size[v] for v in op.outputs)
        peak = max(peak, used + op.workspace_bytes)
        for v in dict.fromkeys(op.inputs):
            left[v] -= 1
            if left[v] == 0 and v not in outputs and v not in inputs:
                used -= size[v]
        used -= sum(size[v] for v in op.outputs if left[v] == 0 and v not in outputs)
    return peak


def greedy_order(graph: Graph) -> tuple[int, ...]:
    """Among the ready ops, the one whose run grows memory least (outputs made minus inputs it frees)."""
    idx = graph.op_index
    deps = [{idx[graph.producer[v]] for v in op.inputs if v in graph.producer} for op in graph.ops]
    succ: list[list[int]] = [[] for _ in graph.ops]
    for i, ds in enumerate(deps):
        for j in ds:
            succ[j].append(i)
    readers: dict[str, int] = {}
    for op in graph.ops:
        for v in dict.fromkeys(op.inputs):
            readers[v] = readers.get(v, 0) + 1
    size = {v.id: v.nbytes for v in graph.values}
    keep = set(graph.outputs) | set(graph.inputs)
    waiting = [len(ds) for ds in deps]
    ready = {i for i, n in enumerate(waiting) if n == 0}
    order: list[int] = []
    while ready:

        def growth(i: int) -> tuple[int, int]:
            op = graph.ops[i]
            freed = sum(size[v] for v in dict.fromkeys(op.inputs) if readers[v] == 1 and v not in keep)
            return (sum(size[v] for v in op.outputs) - freed, i)

        i = min(ready, key=growth)
        ready.discard(i)
        order.append(i)
        for v in dict.fromkeys(graph.ops[i].inputs):
            readers[v] -= 1
        for j in succ[i]:
            waiting[j] -= 1
            if waiting[j] == 0:
                ready.add(j)
    return tuple(order)


def depth_first_order(graph: Graph) -> tuple[int, ...]:
    """Each graph output's producers depth-first (inputs before the ops reading them), then any op left."""
    idx = graph.op_index
    done: set[int] = set()
    order: list[int] = []

    def visit(i: int) -> None:
        stack = [(i, False)]
        while stack:
            j, expanded = stack.pop()
            if j in done:
                continue
            if expanded:
                done.add(j)
                order.append(j)
                continue
            stack.append((j, True))
            for v in reversed(graph.ops[j].inputs):
                p = graph.producer.get(v)
                if p is not None and idx[p] not in done:
                    stack.append((idx[p], False))

    for v in graph.outputs:
        if v in graph.producer:
            visit(idx[graph.producer[v]])
    for i in range(len(graph.ops)):
        visit(i)
    return tuple(order)


def first_compute_indices(graph: Graph, plan: Plan) -> tuple[int, ...]:
    """The op indices in the order the plan first computes them."""
    return tuple(graph.op_index[o] for o in plan.first_computes())


def unbudgeted_plan(graph: Graph, order: Sequence[int], device: str, homes: Mapping[str, str]) -> Plan:
    """Every op once in `order` on `device`, each value freed after its last read: not checked against any budget
    (a solver hint: its memory may exceed the budget, the solver repairs it)."""
    steps = place_frees(graph, [Compute(graph.ops[i].id, device) for i in order], homes)
    return Plan(
        graph=graph.fingerprint, budgets={}, homes=dict(homes), steps=steps, solver=SolveResult("order", "heuristic")
    )


def starting_orders(graph: Graph, warm: Plan | None = None) -> dict[str, tuple[int, ...]]:
    """Named candidate orders, duplicates dropped: the warm start's own order first (a scorer warm-started from
    that plan has a complete hint there, so it gives a plan there at least: a search that gives up after one
    order must not spend it elsewhere), then the least eager peak first."""
    cands = {"graph": tuple(range(len(graph.ops))), "greedy": greedy_order(graph), "dfs": depth_first_order(graph)}
    unique: dict[tuple[int, ...], str] = {}
    for name, o in cands.items():
        unique.setdefault(o, name)
    ranked = {name: o for o, name in sorted(unique.items(), key=lambda x: eager_peak_of(graph, x[0]))}
    if warm is None or not topological(graph, own := first_compute_indices(graph, warm)):
        return ranked
    return {unique.get(own, "warm"): own} | {name: o for name, o in ranked.items() if o != own}


def neighbours(graph: Graph, order: tuple[int, ...], rng: random.Random, k: int) -> list[tuple[int, ...]]:
    """Up to k orders one move away: an op moved to another position between its last producer and its first
    reader (so the order stays topological)."""
    pos = {i: q for q, i in enumerate(order)}
    idx = graph.op_index
    preds = [[pos[idx[graph.producer[v]]] for v in op.inputs if v in graph.producer] for op in graph.ops]
    succs: list[list[int]] = [[] for _ in graph.ops]
    for i, op in enumerate(graph.ops):
        for v in op.inputs:
            if v in graph.producer:
                succs[idx[graph.producer[v]]].append(pos[i])
    out: list[tuple[int, ...]] = []
    tries = 0
    while len(out) < k and tries < 20 * k:
        tries += 1
        q = rng.randrange(len(order))
        i = order[q]
        lo, hi = max(preds[i], default=-1) + 1, min(succs[i], default=len(order)) - 1
        if hi - lo < 1:
            continue
        to = rng.randint(lo, hi)
        if to == q:
            continue
        rest = list(order[:q] + order[q + 1 :])
        rest.insert(to, i)
        cand = tuple(rest)
        if cand != order and topological(graph, cand) and cand not in out:
            out.append(cand)
    return out


def search_order(
    graph: Graph,
    score: Scorer,
    time_limit_s: float,
    warm: Plan | None = None,
    seed: int = 0,
    alpha_energy: float = 0.0,
    per_try_s: float | None = None,
    give_up: int | None = None,
    max_orders: int | None = None,
    first_whole: bool = False,
) -> tuple[Plan | None, tuple[int, ...], OrderSearchStats]:
    """The best plan (objective.better) over starting orders then local moves from the best one, within
    `time_limit_s`.

    Each order is scored by `score(order, seconds)` (the fixed-order solver under a short limit). Returns the best
    plan (None: no order gave one), its order, and a log (orders tried, the best order's origin). give_up: stop
    when that many starting orders gave no plan and none gave one (the caller then spends the time elsewhere);
    max_orders: stop after scoring that many orders (a deterministic end, whatever the machine's speed);
    first_whole: a starting order scored before any gave a plan gets all the time left, not its share (a large
    graph's first plan takes more than a share, and the scorer now keeps its limit)."""
    t0 = time.perf_counter()
    starts = starting_orders(graph, warm)
    per = per_try_s or max(time_limit_s / (2 * len(starts) + 4), 0.5)
    best: Plan | None = None
    best_order = next(iter(starts.values()))
    origin, tried = "none", 0

    for name, o in starts.items():
        left = time_limit_s - (time.perf_counter() - t0)
        if left <= 0.05 or tried == max_orders:
            break
        p = _try(score, o, left if first_whole and best is None else min(per, left))
        tried += 1
        if better(p, best, alpha_energy):
            best, best_order, origin = p, o, name
        if give_up is not None and tried >= give_up and best is None:
            origin = f"none (no plan from {tried} starting orders)"
            return None, best_order, OrderSearchStats("", tried, origin, time.perf_counter() - t0)
    rng = random.Random(seed)
    seen = set(starts.values())  # scoring an order again under the same limit finds the same plan
    stale = 0
    while time_limit_s - (time.perf_counter() - t0) > per and tried != max_orders:  # moves from the best order
        moved = False
        moves = neighbours(graph, best_order, rng, 4)
        if not moves:
            break  # no op can move (a chain): the order is forced
        cands = [c for c in moves if c not in seen]
        stale = 0 if cands else stale + 1
        if stale >= STALE_DRAWS:
            break  # every move drawn lately was scored already: a local optimum of a small graph
        for cand in cands:
            left = time_limit_s - (time.perf_counter() - t0)
            if left <= 0.05 or tried == max_orders:
                break
            seen.add(cand)
            p = _try(score, cand, min(per, left))
            tried += 1
            if better(p, best, alpha_energy):
                best, best_order, origin, moved = p, cand, origin.split("+")[0] + "+moves", True
                break
        if best is None and not moved:
            best_order = moves[-1]  # no plan yet: walk on rather than circle the first start
    return best, best_order, OrderSearchStats("", tried, origin, time.perf_counter() - t0)


def searched(name: str, problem: Problem, options: SolverOptions, warm: Plan | None, score, kw) -> Outcome:
    """The order search with `score` as a registered solver's outcome (`kw`: search_order's limits)."""
    t0 = time.perf_counter()
    limit = options.time_limit_s if options.time_limit_s is not None else 3600.0
    found, _, stats = search_order(problem.graph, score, limit, warm, options.seed, options.alpha_energy, **kw)
    stats = replace(stats, scorer=name.split("-")[1])
    times = Times(solve_s=time.perf_counter() - t0)
    if found is None:
        return Outcome(SolveResult(name, "no_incumbent", times=times, stats=stats, message=_why(stats)))
    value = objective(found, options.alpha_energy)
    return Outcome(SolveResult(name, "heuristic", value, times=times, stats=stats), found)


def _why(stats: OrderSearchStats) -> str:
    return f"no order gave a plan ({stats.orders_tried} scored in {stats.search_s:.1f} s)"


def _try(score: Scorer, order: tuple[int, ...], seconds: float) -> Plan | None:
    try:
        return score(order, seconds)
    except XschedError:  # no plan for this order in its time (or none at all): another order may have one
        return None
