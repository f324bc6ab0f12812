"""Gap rematerialization: at the memory peak, free a value between two of its uses and compute it again before
the later one, cheapest time per byte saved first. A heuristic for any DAG on one device, wide forward-only ones
included, where checkpointing has nothing to drop and eviction cascades into recomputing whole ancestries."""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from xsched.budgets import format_bytes
from xsched.contracts.graph import Graph
from xsched.contracts.plan import Compute, Plan
from xsched.contracts.profile import Profile
from xsched.contracts.result import HeuristicStats
from xsched.errors import BudgetError
from xsched.solve.heuristics.routing import best_single_device, op_workspace, route_and_finish
from xsched.solve.objective import best_of
from xsched.solve.options import DEFAULTS, SolverOptions, keeps_limit, out_of_time
from xsched.solve.order.order import starting_orders
from xsched.solve.problem import Problem

MAX_DEPTH = 4  # levels of inputs made again for one rerun (past it, they are held longer instead)
MAX_RERUNS = 8  # values made again for one drop, past which the inputs are held longer instead
RESCAN_MAX_OPS = 2000  # above this many ops, several drops per scan of the values (lazy greedy)
MAX_DROPS = 8  # per op of the graph: a bound on the greedy's iterations (each drop frees bytes at the peak)


@dataclass(frozen=True)
class _Drop:
    """Free `value` after its use at position `a`, run its producer again right before position `b`; `extend`
    holds inputs of the reruns past their last use to `b` (value, span index, from, to)."""

    value: str
    span: int
    a: int
    b: int
    extend: tuple[tuple[str, int, int, int], ...]
    reruns: tuple[str, ...]  # ops to run before position b: `value`'s producer and what it needs made again
    lo: int
    delta: np.ndarray  # the change in bytes at positions lo..b


class _Timeline:
    """Bytes resident at each position of an order, as spans [first, last] of positions per value."""

    def __init__(self, graph: Graph, order: Sequence[int], device: str, profile: Profile | None) -> None:
        self.graph, self.device = graph, device
        self.ops = [graph.ops[i] for i in order]
        self.pos = {op.id: t for t, op in enumerate(self.ops)}
        n = len(self.ops)
        self.workspace = {op.id: op_workspace(op, device, profile) for op in self.ops}
        self.mem = np.array([self.workspace[op.id] for op in self.ops], dtype=np.int64)
        self.nbytes = {v.id: v.nbytes for v in graph.values}
        self.uses: dict[str, list[int]] = {}
        self.spans: dict[str, list[list[int]]] = {}
        self.fixed = set(graph.inputs) | set(graph.outputs)
        for v in graph.values:
            reads = sorted({self.pos[c] for c in graph.consumers.get(v.id, ())})
            made = self.pos[graph.producer[v.id]] if v.id in graph.producer else 0
            last = n - 1 if v.id in self.fixed else max(reads, default=made)
            self.uses[v.id], self.spans[v.id] = reads, [[made, last]]
            self.mem[made : last + 1] += v.nbytes
        self.redo: dict[int, list[str]] = {}  # position -> producers run again right before it

    def held_at(self, v: str, t: int) -> bool:
        return any(s <= t <= e for s, e in self.spans[v])

    def gap(self, v: str, k: int, t: int) -> tuple[int, int | None] | None:
        """The gap of span `k` of `v` around position `t`: (its last read before `t`, the span's start counting as
        one; its next read after `t` in the span, None if none), or None when `v` is read at `t` or nothing is
        before it."""
        s, e = self.spans[v][k]
        points = [s, *(x for x in self.uses[v] if s < x <= e)]
        if t in points:
            return None
        a = max((x for x in points if x < t), default=None)
        return None if a is None else (a, min((x for x in points if x > t), default=None))

    def drop(self, v: str, k: int, t: int, budget: int, depth: int) -> _Drop | None:
        """Freeing span `k` of `v` around position `t`, or None when `v` is read at `t`, the gap does not cover
        `t`, or the change does not lower `t` or pushes another position over the budget."""
        gap = self.gap(v, k, t)
        if gap is None or gap[1] is None:
            return None
        a, b = gap
        changes = [(a + 1, b - 1, -self.nbytes[v])]
        extend: list[tuple[str, int, int, int]] = []
        reruns: list[str] = []
        self._rerun(v, b, t, depth, changes, extend, reruns, {v})
        lo = min(c[0] for c in changes)
        delta = np.zeros(b + 1 - lo, dtype=np.int64)  # positions lo..b: nothing changes outside them
        for first, last, n in changes:
            delta[first - lo : last + 1 - lo] += n
        if delta[t - lo] >= 0:
            return None
        grown = delta > 0
        window = self.mem[lo : b + 1]
        if np.any(window[grown] + delta[grown] > np.maximum(window[grown], budget)):
            return None
        return _Drop(v, k, a, b, tuple(extend), tuple(reruns), lo, delta)

    def _rerun(
        self, v: str, b: int, t: int, depth: int, changes: list, extend: list, reruns: list, ready: set[str]
    ) -> None:
        """Run `v`'s producer again right before position `b`: each input it needs that is gone by then is held
        longer, or, when holding it would cover the peak `t`, made again there too (up to `depth` levels)."""
        producer = self.graph.op[self.graph.producer[v]]
        for u in dict.fromkeys(producer.inputs):
            if u in ready or self.held_at(u, b):
                continue
            ready.add(u)
            j = max(j for j, (_, end) in enumerate(self.spans[u]) if end < b)  # u was made before its reader
            held_to = self.spans[u][j][1]
            if held_to < t and depth > 0 and u in self.graph.producer and len(ready) <= MAX_RERUNS:
                changes.append((b, b, self.nbytes[u]))  # made again, gone after this position
                self._rerun(u, b, t, depth - 1, changes, extend, reruns, ready)
            else:
                extend.append((u, j, held_to + 1, b))
                changes.append((held_to + 1, b, self.nbytes[u]))
        # the rerun's other outputs and workspace, beyond what the op at b itself adds there
        op_b = self.ops[b]
        rerun = sum(self.nbytes[w] for w in producer.outputs if w != v) + self.workspace[producer.id]
        own = sum(self.nbytes[w] for w in op_b.outputs) + self.workspace[op_b.id]
        changes.append((b, b, max(0, rerun - own)))
        reruns.append(producer.id)

    def apply(self, d: _Drop) -> None:
        s, e = self.spans[d.value][d.span]
        self.spans[d.value][d.span : d.span + 1] = [[s, d.a], [d.b, e]]
        for u, j, _, to in d.extend:
            self.spans[u][j][1] = to
        for p in d.reruns:
            for w in self.graph.op[p].outputs:
                self.spans[w].append([d.b, d.b])
            for u in self.graph.op[p].inputs:
                if d.b not in self.uses[u]:
                    self.uses[u] = sorted([*self.uses[u], d.b])
        for u in {x for x, *_ in d.extend} | {w for p in d.reruns for w in self.graph.op[p].outputs}:
            self.spans[u] = _merged(self.spans[u])
        self.redo.setdefault(d.b, []).extend(d.reruns)
        self.mem[d.lo : d.b + 1] += d.delta

    def computes(self) -> list[Compute]:
        out = []
        for t, op in enumerate(self.ops):
            reruns = sorted(set(self.redo.get(t, ())), key=self.graph.op_index.__getitem__)
            out += [Compute(p, self.device) for p in reruns]
            out.append(Compute(op.id, self.device))
        return out


def _merged(spans: list[list[int]]) -> list[list[int]]:
    out: list[list[int]] = []
    for s, e in sorted(spans):
        if out and s <= out[-1][1] + 1:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return out


def peak_error(method: str, line: _Timeline, t: int, budget: int, device: str) -> BudgetError:
    """`method` found nothing that lowers the peak at position `t` of `line`: the op, its bytes and the budget."""
    return BudgetError(
        f"{method} cannot lower the peak at {line.ops[t].id}: "
        f"{format_bytes(int(line.mem[t]))} over a budget of {format_bytes(budget)} on {device}",
        stage="solve",
        op=line.ops[t].id,
        device=device,
    )


def gap_computes(
    graph: Graph, order: Sequence[int], device: str, budget: int, profile: Profile | None = None, depth: int = 0
) -> list[Compute]:
    """`order` with reruns: while the predicted peak is over `budget`, apply the drop at the peak position with
    the least rerun time per byte freed there; a rerun makes up to `depth` levels of its missing inputs again
    rather than hold them. BudgetError when no drop lowers the peak."""
    line = _Timeline(graph, order, device, profile)
    cost = {o.id: (c.time_s if profile and (c := profile.op_cost(o.id, device)) else 1.0) for o in graph.ops}
    drops = 0
    while drops < MAX_DROPS * len(graph.ops):
        t = int(line.mem.argmax())
        if line.mem[t] <= budget:
            return line.computes()
        ranked = []
        for rank, v in enumerate(line.spans):
            if v in line.fixed or line.nbytes[v] == 0:
                continue
            for k, (s, e) in enumerate(line.spans[v]):
                if s < t < e and (d := line.drop(v, k, t, budget, depth)) is not None:
                    ranked.append((sum(cost[p] for p in d.reruns) / -d.delta[t - d.lo], rank, v))
        if not ranked:
            raise peak_error("gap rematerialization", line, t, budget, device)
        # lazy greedy at t while it stays the peak: the best stale key is checked again and applied if it is still
        # no worse than the next one, else queued with its fresh key (one scan of the values for many drops)
        heapq.heapify(ranked)
        while ranked and line.mem[t] > budget and line.mem[t] >= line.mem.max():
            _, rank, v = heapq.heappop(ranked)
            k = next((k for k, (s, e) in enumerate(line.spans[v]) if s < t < e), None)  # spans split and merge
            if k is None or (d := line.drop(v, k, t, budget, depth)) is None:
                continue
            key = sum(cost[p] for p in d.reruns) / -d.delta[t - d.lo]
            if ranked and (key, rank) > ranked[0][:2]:
                heapq.heappush(ranked, (key, rank, v))
                continue
            line.apply(d)
            drops += 1
            if len(graph.ops) <= RESCAN_MAX_OPS:
                break  # small enough to scan every value again after each drop, which finds better drops
    raise BudgetError(f"gap rematerialization gave up after {drops} drops on {device}", stage="solve", device=device)


@keeps_limit
def gap_remat(problem: Problem, options: SolverOptions = DEFAULTS, warm: Plan | None = None) -> Plan:
    """Gap rematerialization on each single device, from each starting order (graph and memory-greedy), with
    missing inputs of a rerun held or made again (a chain of reruns, as checkpointing does); the best plan."""
    graph, profile, budgets, homes = problem.graph, problem.profile, problem.budgets, problem.homes
    orders, alpha = starting_orders(graph), options.alpha_energy
    return best_single_device(
        lambda d: fastest_plan(graph, profile, budgets, homes, d, orders, alpha),
        graph,
        profile,
        problem.devices,
        "gaps",
        alpha,
    )


def fastest_plan(
    graph: Graph,
    profile: Profile | None,
    budgets: Mapping[str, int],
    homes: Mapping[str, str],
    device: str,
    orders: Mapping[str, Sequence[int]],
    alpha_energy: float = 0.0,
) -> Plan:
    """The best gaps plan (objective.better) on `device` over the named orders, each with reruns one level deep and MAX_DEPTH
    levels deep; BudgetError saying why each failed when none fits."""
    t0 = time.perf_counter()
    plans, why = [], []
    depths = (0, MAX_DEPTH) if device in budgets else (0,)  # no budget on the device: each order as it is
    for k, ((name, order), depth) in enumerate(itertools.product(orders.items(), depths)):
        if k and out_of_time():  # the first variant runs however late: a plan to return
            why.insert(0, f"stopped at the time limit after {k} variants")
            break
        try:
            if device in budgets:
                computes = gap_computes(graph, order, device, budgets[device], profile, depth)
            else:
                computes = [Compute(graph.ops[i].id, device) for i in order]
            stats = HeuristicStats(device=device, order=name, depth=depth, recomputes=len(computes) - len(graph.ops))
            plans.append(route_and_finish(graph, computes, "gaps", budgets, homes, profile, t0, stats))
        except BudgetError as e:
            why.append(f"{name} order, depth {depth}: {e.detail}")
    if not plans:
        raise BudgetError("; ".join(why), stage="solve", device=device)
    return best_of(plans, alpha_energy)


def order_scorer(
    graph: Graph,
    profile: Profile,
    budgets: Mapping[str, int],
    device: str,
    homes: Mapping[str, str],
    alpha_energy: float = 0.0,
) -> Callable[[tuple[int, ...], float], Plan]:
    """`search_order`'s scorer from gap rematerialization: an order's fastest gaps plan on `device` (BudgetError:
    none fits). Milliseconds to a few seconds an order, so the search tries hundreds where CP-SAT tries a few."""

    def score(order: tuple[int, ...], seconds: float) -> Plan:  # no time limit of its own to pass `seconds` to
        return fastest_plan(graph, profile, budgets, homes, device, {"searched": order}, alpha_energy)

    return score
