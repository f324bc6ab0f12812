"""Gap rematerialization: at the memory peak, free a value between two of its uses and compute it again before
the later one, cheapest time per byte saved first. A heuristic for any DAG on one device, wide forward-only ones
included, where checkpointing has nothing to drop and eviction cascades into recomputing whole ancestries."""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable, Mapping, Sequence

from xsched.contracts.graph import Graph
from xsched.contracts.plan import Compute, Plan
from xsched.contracts.profile import Profile
from xsched.contracts.result import HeuristicStats
from xsched.errors import BudgetError
from xsched.solve.heuristics.routing import best_single_device, route_and_finish
from xsched.solve.heuristics.timeline import Timeline, op_seconds
from xsched.solve.objective import best_of
from xsched.solve.options import DEFAULTS, SolverOptions, keeps_limit, out_of_time
from xsched.solve.order.order import starting_orders
from xsched.solve.problem import Problem, runnable

MAX_DEPTH = 4  # levels of inputs made again for one rerun (past it, they are held longer instead)
RESCAN_MAX_OPS = 2000  # above this many ops, several drops per scan of the values (lazy greedy)
MAX_DROPS = 8  # per op of the graph: a bound on the greedy's iterations (each drop frees bytes at the peak)


def gap_computes(
    graph: Graph, order: Sequence[int], device: str, budget: int, profile: Profile | None = None, depth: int = 0
) -> list[Compute]:
    """`order` with reruns: while the predicted peak is over `budget`, apply the drop at the peak position with
    the least rerun time per byte freed there; a rerun makes up to `depth` levels of its missing inputs again
    rather than hold them. BudgetError when no drop lowers the peak."""
    line = Timeline(graph, [graph.ops[i] for i in order], device, profile)
    cost = op_seconds(graph, device, profile)
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
                    ranked.append((sum(cost[p] for p in d.reruns) / d.freed(t), rank, v))
        if not ranked:
            raise line.peak_error("gap rematerialization", t, budget)
        # lazy greedy at t while it stays the peak: the best stale key is checked again and applied if it is still
        # no worse than the next one, else queued with its fresh key (one scan of the values for many drops)
        heapq.heapify(ranked)
        while ranked and line.mem[t] > budget and line.mem[t] >= line.mem.max():
            _, rank, v = heapq.heappop(ranked)
            k = next((k for k, (s, e) in enumerate(line.spans[v]) if s < t < e), None)  # spans split and merge
            if k is None or (d := line.drop(v, k, t, budget, depth)) is None:
                continue
            key = sum(cost[p] for p in d.reruns) / d.freed(t)
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
        lambda d: fastest_plan(graph, profile, budgets, homes, d, orders, alpha, problem.devices),
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
    via: Sequence[str] = (),
) -> Plan:
    """The best gaps plan (objective.better) on `device` over the named orders, each with reruns one level deep and MAX_DEPTH
    levels deep (copies through `via` where no link is direct: route); BudgetError saying why each failed when none fits."""
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
            plan = route_and_finish(graph, computes, "gaps", budgets, homes, profile, t0, stats, via)
            # wrap's boundary rule, which the orders do not model: repaired here or refused, so the fastest variant
            # that wrap can run wins (one that breaks it would sink the method in the caller's check)
            plans.append(runnable(graph, plan, profile, budgets) if profile is not None else plan)
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
    via: Sequence[str] = (),
) -> Callable[[tuple[int, ...], float], Plan]:
    """`search_order`'s scorer from gap rematerialization: an order's fastest gaps plan on `device` (BudgetError:
    none fits). Milliseconds to a few seconds an order, so the search tries hundreds where CP-SAT tries a few."""

    def score(order: tuple[int, ...], seconds: float) -> Plan:  # no time limit of its own to pass `seconds` to
        return fastest_plan(graph, profile, budgets, homes, device, {"searched": order}, alpha_energy, via)

    return score
