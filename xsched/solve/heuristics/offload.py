"""Activation offloading: compute on one device and park values on another between two distant uses (swapping,
as vDNN and Capuchin do), with the copy back issued a few ops early so it can hide behind compute; combined with
checkpointing when parking alone does not fit."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import replace

from xsched.budgets import format_bytes
from xsched.contracts.graph import Graph
from xsched.contracts.plan import Compute, Copy, Free, Plan, Step
from xsched.contracts.profile import Profile
from xsched.contracts.result import HeuristicStats
from xsched.errors import BudgetError, PlanError
from xsched.solve.heuristics.checkpoint import candidate_keeps, checkpoint_computes, compute_time
from xsched.solve.heuristics.evict import evict_computes
from xsched.solve.heuristics.routing import finish, finish_with_early_homes, route
from xsched.solve.heuristics.timeline import Liveness
from xsched.solve.objective import better, objective
from xsched.solve.options import DEFAULTS, SolverOptions, keeps_limit, out_of_time
from xsched.solve.problem import Problem

PREFETCH_OPS = (8, 2, 0)  # how many computes early a copy back is issued, tried in this order
MAX_ORDERS = 24  # checkpointing orders tried when parking alone does not fit


def widest_gaps(graph: Graph, computes: Sequence[Compute], homes: Mapping[str, str]) -> list[tuple[int, int, str]]:
    """(last event, next read, value): for each value its widest stretch of computes (one device's) with no use
    between a compute that makes or reads it and the next compute reading it. Graph inputs homed on the compute
    device stay (they are never freed there); a stretch ending in a recompute needs no parking."""
    device = computes[0].device if computes else ""
    best: dict[str, tuple[int, int]] = {}
    for i, j, v in Liveness(graph, [graph.op[c.op] for c in computes], device).stretches:
        if homes.get(v) != device and j - i > 1 and (v not in best or j - i > best[v][1] - best[v][0]):
            best[v] = (i, j)
    return [(i, j, v) for v, (i, j) in best.items()]


def with_parking(
    computes: Sequence[Compute],
    parked: Sequence[tuple[int, int, str]],
    store: str,
    prefetch: int,
    homes: Mapping[str, str],
) -> list[Compute | Copy]:
    """`computes` with each parked value copied to `store` after compute i (unless `store` is its home, which
    holds it anyway) and back `prefetch` computes before compute j (never before i + 1). route() adds the other
    copies and the frees (after each residency's last read: the copy out frees the compute device until the
    copy back)."""
    out_after: dict[int, list[str]] = {}
    back_before: dict[int, list[str]] = {}
    for i, j, v in parked:
        if homes.get(v) != store:
            out_after.setdefault(i, []).append(v)
        back_before.setdefault(max(i + 1, j - prefetch), []).append(v)
    steps: list[Compute | Copy] = []
    for k, c in enumerate(computes):
        steps += [Copy(v, store, c.device) for v in back_before.get(k, ())]
        steps.append(c)
        steps += [Copy(v, c.device, store) for v in out_after.get(k, ())]
    return steps


def _parked_plan(graph, computes, parked, store, homes, profile, prefetch, defer=False, lanes=True) -> Plan:
    """The routed plan, simulated, budgets not checked. With `defer`, the frees that follow a copy out wait
    until after the next compute on the device, which then need not wait for the copy (more memory, less time).
    Without `lanes`, its prediction has peaks and the serial time but no makespan."""
    steps = route(graph, with_parking(computes, parked, store, prefetch, homes), homes, profile, via=(store,))
    if defer:
        steps = deferred_frees(steps, {v for _, _, v in parked})
    return finish(graph, steps, "offload", {}, homes, profile, 0.0, lanes=lanes)


def deferred_frees(steps: Sequence[Step], parked: set[str]) -> tuple[Step, ...]:
    """Each free of a parked value right after its copy out moved behind the next compute on that device."""
    out: list[Step] = []
    waiting: dict[str, list[Free]] = {}  # device -> frees to place after its next compute
    for k, s in enumerate(steps):
        prev = steps[k - 1] if k else None
        if isinstance(s, Free) and s.value in parked and isinstance(prev, Copy) and prev.value == s.value:
            waiting.setdefault(s.device, []).append(s)
            continue
        if isinstance(s, Copy) and any(f.value == s.value for f in waiting.get(s.dst, ())):
            out += [f for f in waiting[s.dst] if f.value == s.value]  # back before the next compute: free first
            waiting[s.dst] = [f for f in waiting[s.dst] if f.value != s.value]
        out.append(s)
        if isinstance(s, Compute):
            out += waiting.pop(s.device, [])
    return (*out, *(f for fs in waiting.values() for f in fs))


def _fits(plan: Plan, budgets: Mapping[str, int], devices: Sequence[str]) -> bool:
    return all(plan.predicted.peak_bytes.get(d, 0) <= budgets[d] for d in devices if d in budgets)


def recompute_orders(graph: Graph, device: str, budget: int | None, profile: Profile | None) -> list[list[Compute]]:
    """At most MAX_ORDERS checkpointing orders, fewest recomputes first, evenly spread over the keep sets; then
    eviction's order at the budget (it fits the compute device with nothing parked, when it exists)."""
    keeps = candidate_keeps(graph)
    orders = sorted(
        (checkpoint_computes(graph, k, device) for n, k in enumerate(keeps) if not (n and out_of_time())), key=len
    )
    step = max(1, len(orders) / MAX_ORDERS)
    orders = [orders[int(k * step)] for k in range(min(len(orders), MAX_ORDERS))]
    if budget is not None and not out_of_time():
        try:
            orders.append(evict_computes(graph, device, budget, profile))
        except BudgetError:
            pass  # no eviction order fits the budget alone: parking must do the rest
    return orders


@keeps_limit
def offload_search(problem: Problem, options: SolverOptions = DEFAULTS, warm: Plan | None = None) -> Plan:
    """The best fitting plan (objective.better) that computes on one device and parks values on another, over the
    compute orders graph order (no recompute), checkpoint keep sets (fewest recomputes first) and eviction at the
    budget."""
    t0 = time.perf_counter()
    graph, profile, budgets, devices, homes = (
        problem.graph,
        problem.profile,
        problem.budgets,
        problem.devices,
        problem.homes,
    )
    alpha = options.alpha_energy
    pairs = [(c, s) for c in devices for s in devices if c != s]
    if not pairs:
        raise BudgetError(
            f"offloading needs two devices, got {list(devices)}", stage="solve", device=devices[0] if devices else None
        )
    failures: list[str] = []
    best: tuple[Plan, HeuristicStats] | None = None
    for c in dict.fromkeys(c for c, _ in pairs):
        if profile is not None and not all(profile.can_run(o.id, c) for o in graph.ops):
            failures.append(f"{c}: cannot run every op")
            continue
        orders = [[Compute(o.id, c) for o in graph.ops], *recompute_orders(graph, c, budgets.get(c), profile)]
        for store in (s for d, s in pairs if d == c):
            try:
                found = _best_fit(graph, orders, store, budgets, homes, profile, alpha)
            except (PlanError, BudgetError) as e:  # no copy link between the two (PlanError) or none on home
                failures.append(f"compute on {c}, park on {store}: {e.detail}")
                continue
            if isinstance(found, str):
                failures.append(f"compute on {c}, park on {store}: {found}")
            elif best is None or better(found[0], best[0], alpha):
                best = found
    if best is None:
        has = ", ".join(f"{d} {format_bytes(b)}" for d, b in budgets.items())
        raise BudgetError("offload: " + "; ".join(failures) + f" (budgets: {has})", stage="solve")
    # the orders were ranked with their copies home at the end (route's); the winner's issued early where better
    return finish_with_early_homes(graph, best[0].steps, "offload", budgets, homes, profile, t0, stats=best[1])


def _best_fit(graph, orders, store, budgets, homes, profile, alpha: float) -> tuple[Plan, HeuristicStats] | str:
    """(plan, its stats) of the best order (objective.better) that fits when parking its widest gaps (bytes x computes,
    largest first), or why none does, in words. Parking more frees the compute device and fills the store, so
    each order parks the fewest such values that fit the compute device (bisection), at the earliest prefetch
    distance that fits, if the store holds them. Orders whose computes alone take longer than the best plan
    so far are skipped: parking cannot make them faster."""
    c = orders[0][0].device
    why = f"no order fits {c}, even parking every gap"
    best: tuple[Plan, HeuristicStats] | None = None
    for n, computes in enumerate(orders):
        if n and out_of_time():  # the first order runs however late
            return best if best is not None else f"stopped at the time limit after {n} of {len(orders)} orders"
        # a bound, not a ranking: no plan of these computes has an objective below their own time
        if best is not None and compute_time(computes, profile) >= objective(best[0], alpha):
            continue
        found = _fit_order(graph, computes, store, budgets, homes, profile, alpha)
        if isinstance(found, str):
            why = found or why  # only read when no order fits
            continue
        if best is None or better(found[0], best[0], alpha):
            best = (found[0], replace(found[1], order=str(n)))
    return best if best is not None else why


def _fit_order(graph, computes, store, budgets, homes, profile, alpha: float) -> tuple[Plan, HeuristicStats] | str:
    """One order's plan (see _best_fit); "" when it does not fit its compute device, else why not."""
    c = computes[0].device
    cands = sorted(widest_gaps(graph, computes, homes), key=lambda g: -(g[1] - g[0]) * graph.value[g[2]].nbytes)
    # (values parked, prefetch) -> plan; the bisection revisits some, and asks only whether a plan fits, so these
    # plans skip the lanes' timing (most of a simulation's cost)
    untimed: dict[tuple[int, int], Plan] = {}

    def fits(k: int, prefetch: int, devices: Sequence[str]) -> bool:
        if (k, prefetch) not in untimed:
            untimed[(k, prefetch)] = _parked_plan(
                graph, computes, cands[:k], store, homes, profile, prefetch, lanes=False
            )
        return _fits(untimed[(k, prefetch)], budgets, devices)

    if not fits(len(cands), 0, [c]):
        return ""  # parking every gap with no prefetch is the leanest this order gets on its compute device
    for prefetch in PREFETCH_OPS:
        if not fits(len(cands), prefetch, [c]):
            continue
        lo, hi = 0, len(cands)
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if fits(mid, prefetch, [c]) else (mid + 1, hi)
        if not fits(lo, prefetch, [c]):  # the peak is not monotone in the prefix: park every gap
            lo = len(cands)
        if not fits(lo, prefetch, list(budgets)):
            return f"what {c} must park to fit overflows {store}"
        plan = _parked_plan(graph, computes, cands[:lo], store, homes, profile, prefetch)
        deferred = _parked_plan(graph, computes, cands[:lo], store, homes, profile, prefetch, defer=True)
        defer = _fits(deferred, budgets, list(budgets)) and better(deferred, plan, alpha)
        plan = deferred if defer else plan
        recomputes = len(computes) - len(graph.ops)
        return plan, HeuristicStats(parked=lo, prefetch_ops=prefetch, deferred_frees=defer, recomputes=recomputes)
    return ""
