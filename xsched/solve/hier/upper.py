"""Options of a block above the bottom level: its children's options combined — each child once with its fastest
option, each once with its leanest, and the H-ILP at budgets between and below those two plans' peaks (where it
recomputes children) — for the inputs from other blocks on each device in turn."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

from xsched.contracts.plan import Plan
from xsched.contracts.profile import Profile
from xsched.errors import BudgetError, XschedError
from xsched.solve.hier.hextract import direct_plan
from xsched.solve.hier.hilp import Unit, solve_hilp
from xsched.solve.hier.hindex import index
from xsched.solve.hier.leaf import deferred_options, deferring, stores_of
from xsched.solve.hier.menu import Option, fastest, leanest, pareto, summarize
from xsched.solve.hier.region import Region, plain, region_homes
from xsched.solve.options import SolverOptions

BUDGETS = ((1.0, 0.8), (1.0, 0.6), (0.0, 1.0), (0.0, 0.8), (0.0, 0.6))  # (from the fast (1) or lean (0) peak, x)


@dataclass(frozen=True)
class RegionTask:
    """What a worker needs to make the options of a block above the bottom level."""

    region: Region
    profile: Profile
    units: tuple[Unit, ...]
    devices: tuple[str, ...]
    graph_homes: Mapping[str, str]
    seconds: float  # per H-ILP solve
    limit: int
    seed: int = 0
    deferred: tuple[str, ...] = ()  # its deferrable gradient ops (region.deferrable)
    node_limit: int | None = None  # HiGHS's nodes per H-ILP (SolverOptions.node_limit): a deterministic stop


def region_options(task: RegionTask) -> list[Option]:
    """The block's options (the Pareto front of every plan found, at most `task.limit` per home device and set
    of outputs left, with a plan deferring its gradient ops derived from each)."""
    region, prof, units = task.region, task.profile, task.units
    base = plain(region)  # plans are made without the late outputs, which only a deferring plan keeps
    sub = base.graph
    prof = replace(prof, graph=sub.fingerprint)
    made: list[tuple[Plan, str, str]] = []
    for h in task.devices:
        homes = region_homes(region, task.graph_homes, h)
        ix = index(sub, prof, units, {}, task.devices, homes, region.f_outputs)
        plans = {}
        for name, pick in (("fast", fastest), ("lean", leanest)):
            try:
                plans[name] = direct_plan(ix, [pick(u.options, h) for u in units])
            except XschedError:
                continue
            made.append((plans[name], h, name))
        if not plans:
            continue
        peaks = {name: p.predicted.peak_bytes.get(h, 0) for name, p in plans.items()}
        fast, lean = peaks.get("fast", max(peaks.values())), peaks.get("lean", min(peaks.values()))
        budgets = sorted({int((fast if src else lean) * x) for src, x in BUDGETS} - set(peaks.values()), reverse=True)
        opts = SolverOptions(time_limit_s=task.seconds, solver_threads=1, seed=task.seed, node_limit=task.node_limit)
        for b in budgets:
            try:
                plan = solve_hilp(sub, prof, units, {h: b}, task.devices, homes, region.f_outputs, opts)
            except XschedError:
                continue  # no plan at this budget (or none in time): the others still count
            made.append((plan, h, f"hilp@{b}"))
    if not made:
        raise BudgetError(  # not found, not a proof: its children's options are a sample of their plans
            f"not found: no schedule of block {sub.name} from its children's options",
            stage="solve",
            op=sub.ops[0].id if sub.ops else None,
        )
    found = [summarize(region, p, prof, h, label) for p, h, label in made]
    found += deferring(region, made, prof, task.graph_homes, task.deferred)
    # the children's deferred gradient ops as this block's recomputes (what they read is its boundary too)
    return pareto(found, task.limit, stores_of(prof, task.devices)) + deferred_options(
        region, prof, task.devices, task.graph_homes, task.deferred
    )
