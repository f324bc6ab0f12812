"""The portfolio: within one time limit, the heuristics' best plan, then (on one device) the order search scored by
gap rematerialization, then the order search scored by the CP-SAT interval model, then CP-SAT on the best order (C
raised while it pays), then the linearised interval MILP and the stage MILP on graphs small enough for them, each
warm-started from the best plan so far.

Why this default (measured in scripts/bench_solver.py, docs/bench/solver.md): on the published graphs CP-SAT on
the interval model finds good plans one to two orders of magnitude sooner than either MILP (the stage MILP has
O(T^2) binaries per device, the linearised interval MILP O(slots^2) pairwise memory binaries), and the order is
worth more than the last fraction of the gap, so CP-SAT gets the time first; the MILPs run after it, from its
incumbent, where their size allows. Without OR-Tools the HiGHS backends run alone. Before all of them, on one
device, the order search scored by gap rematerialization: it tries hundreds of orders in the time CP-SAT scores
a few (random_layered_n100 at M = 37,055: 0.65%, where the CP-SAT-scored search reached 1.52%).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import replace

from xsched.contracts.graph import Graph
from xsched.contracts.plan import Plan, SolverInfo
from xsched.contracts.profile import Profile
from xsched.errors import BudgetError, XschedError
from xsched.solve.gap_remat import order_scorer
from xsched.solve.intervals import available, solve_intervals
from xsched.solve.milp import solve_milp
from xsched.solve.options import SolverOptions
from xsched.solve.order import first_compute_indices, search_order, starting_orders
from xsched.solve.problem import runnable

GAPS_ORDER_SHARE = 0.25  # share of the time limit for the order search scored by gap rematerialization (one device)
ORDER_SHARE = 0.35  # share of what is left for the order search scored by CP-SAT
MAIN_SHARE = 0.7  # on small graphs, the share of what is left for CP-SAT on the best order (the MILPs get the rest;
# elsewhere CP-SAT gets all of it, and the stage MILP runs only if CP-SAT proves its optimum early)
GIVE_UP_OPS = 300  # beyond this the order search stops when its first order gives no plan in its share
STAGE_MILP_MAX_OPS = 150  # the stage MILP's O(T^2) model is too big to help beyond this in a minute
INTERVAL_MILP_MAX_SLOTS = 60  # the linearised interval MILP's pairwise memory rows: small graphs only
DEFAULT_OPTIONS = SolverOptions()


def solve_portfolio(
    graph: Graph,
    profile: Profile,
    budgets: Mapping[str, int],
    devices: Sequence[str],
    homes: Mapping[str, str],
    options: SolverOptions = DEFAULT_OPTIONS,
    warm_start: Plan | None = None,
    seed: int = 0,
    workers: int = 0,
) -> Plan:
    """The best simulator-checked plan of the members within `options.time_limit_s`; `solver.extra` says which
    member found it, the order it runs, and each member's time, status and plan time."""
    t0 = time.perf_counter()
    limit = options.time_limit_s if options.time_limit_s is not None else 3600.0
    devices = tuple(devices)
    best, log = warm_start, []
    found_by = "warm start" if best is not None else None
    if best is None:
        from xsched.solve.heuristics import best_heuristic

        best, _ = best_heuristic(graph, profile, budgets, devices, homes)
        found_by = "heuristics" if best is not None else None
        log.append(("heuristics", time.perf_counter() - t0, _status(best), _time(best)))

    def left() -> float:
        return limit - (time.perf_counter() - t0)

    def take(name: str, started: float, fn) -> None:  # run one member, keep its plan if better
        nonlocal best, found_by
        try:
            p = runnable(graph, fn(), profile, budgets)
        except XschedError as e:
            log.append((name, time.perf_counter() - started, f"no plan ({e.detail[:60]})", None))
            return
        log.append((name, time.perf_counter() - started, p.solver.status, _time(p)))
        if best is None or _time(p) < _time(best) - 1e-12:
            best, found_by = p, name

    if len(devices) == 1 and devices[0] in budgets:  # gaps plans on one device
        t1 = time.perf_counter()
        score = order_scorer(graph, profile, budgets, devices[0], homes)
        found, _, gaps_log = search_order(
            graph,
            score,
            GAPS_ORDER_SHARE * left(),
            best,
            seed,
            per_try_s=0.01,
            give_up=len(starting_orders(graph, best)),
        )
        found = _runnable_or_none(graph, found, profile, budgets)
        log.append(("gaps-order-search", time.perf_counter() - t1, _status(found), _time(found)))
        log_orders = {"gaps_orders_tried": gaps_log["orders_tried"]}
        if found is not None and _time(found) < _time(best) - 1e-12:
            best, found_by = found, "gaps-order-search"
    else:
        log_orders = {}
    kw = dict(seed=seed, workers=workers)
    order = first_compute_indices(graph, best) if best is not None else tuple(range(len(graph.ops)))
    if available():

        def score(o: tuple[int, ...], seconds: float) -> Plan:
            opts = replace(options, time_limit_s=seconds)
            return solve_intervals(
                graph, profile, budgets, devices, homes, opts, order=o, warm_start=best, c_max=2, **kw
            )

        t1 = time.perf_counter()
        big = len(graph.ops) > GIVE_UP_OPS  # a first plan may take all the time there: no time for other orders
        found, order, search_log = search_order(
            graph, score, ORDER_SHARE * left(), best, seed, give_up=1 if big else None
        )
        found = _runnable_or_none(graph, found, profile, budgets)
        log.append(("order-search", time.perf_counter() - t1, _status(found), _time(found)))
        if found is not None and (best is None or _time(found) < _time(best)):
            best, found_by = found, "order-search"
        t1 = time.perf_counter()
        small = len(graph.ops) * len(devices) <= INTERVAL_MILP_MAX_SLOTS  # the MILPs run after it only there
        opts = replace(options, time_limit_s=(MAIN_SHARE if small else 1.0) * left())
        take(
            "intervals-cpsat",
            t1,
            lambda: solve_intervals(graph, profile, budgets, devices, homes, opts, order=order, warm_start=best, **kw),
        )
    else:
        search_log = {}
    if len(graph.ops) * len(devices) <= INTERVAL_MILP_MAX_SLOTS and left() > 0.5:
        t1 = time.perf_counter()
        opts = replace(options, time_limit_s=left() * (0.5 if len(graph.ops) <= STAGE_MILP_MAX_OPS else 1.0))
        take(
            "intervals-highs",
            t1,
            lambda: solve_intervals(
                graph, profile, budgets, devices, homes, opts, backend="highs", order=order, warm_start=best
            ),
        )
    maps = best is None or first_compute_indices(graph, best) == tuple(range(len(graph.ops)))
    if len(graph.ops) <= STAGE_MILP_MAX_OPS and left() > 0.5 and maps:  # its warm start needs the graph's order
        t1 = time.perf_counter()
        opts = replace(options, time_limit_s=left())
        take("milp", t1, lambda: solve_milp(graph, profile, budgets, devices, homes, opts, warm_start=best))
    if best is None:
        raise XschedError(f"the portfolio found no plan in {time.perf_counter() - t0:.1f} s", stage="solve")
    floor = sum(min(c.time_s for d in devices if (c := profile.op_cost(o.id, d)) is not None) for o in graph.ops)
    t = _time(best)
    gap = max(0.0, t - floor) / t if t else 0.0  # against every op once at its fastest: a bound for every order
    status = "optimal" if gap <= options.mip_gap else "time_limit"
    info = SolverInfo(
        "portfolio",
        status,
        gap,
        time.perf_counter() - t0,
        {
            **best.solver.extra,
            "found_by": found_by,
            "member_status": best.solver.status,
            "member_gap": best.solver.gap,
            "order": [graph.ops[i].id for i in first_compute_indices(graph, best)],
            "members": [{"member": n, "s": round(s, 3), "status": st, "time_s": ts} for n, s, st, ts in log],
            "objective": t,
            "bound": floor,  # every op once at its fastest: a lower bound for every plan
            **search_log,
            **log_orders,
        },
    )
    return replace(best, solver=info)


def _runnable_or_none(graph: Graph, plan: Plan | None, profile: Profile, budgets: Mapping[str, int]) -> Plan | None:
    """A search's plan if `wrap` can run it (see `problem.runnable`), else None: it must not warm-start the rest."""
    try:
        return runnable(graph, plan, profile, budgets) if plan is not None else None
    except BudgetError:  # the boundary rule; an invalid plan (a bug) propagates
        return None


def _time(p: Plan | None) -> float:
    return float("inf") if p is None else (p.predicted.time_s or 0.0)


def _status(p: Plan | None) -> str:
    return "no plan" if p is None else p.solver.status
