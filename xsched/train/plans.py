"""The plan cache of `xsched train`: the costs come from the profile store (profiles/, measured once per graph,
devices and machine, as `wrap` and `xsched profile` keep them) and the plan is kept beside them under plans/, keyed
by the graph fingerprint, the profile's own fingerprint (its numbers, so another machine or a re-measurement makes
another key), the devices, the budgets, the method, the time limit, and the stores and input homes where given. A
cached plan is checked by the simulator before use; a stale, foreign or unreadable entry is planned again with a
one-line notice."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from xsched.contracts.graph import Graph
from xsched.contracts.plan import Plan
from xsched.contracts.profile import Profile
from xsched.errors import BudgetError, PlanError, XschedError
from xsched.execute.back_to_back import stored_profile
from xsched.files import atomic_write
from xsched.pipeline import DEFAULT_TIME_LIMIT_S, plan_profile, profile_path
from xsched.profiling.measure import check_runnable
from xsched.simulate import simulate

KEY_FIELD = "train_cache_key"


@dataclass(frozen=True)
class CachedPlan:
    """The plan to train with, the costs it was made on, where both are kept, and whether the plan was reused."""

    plan: Plan
    profile: Profile
    path: Path
    profile_path: Path | None  # None for modelled costs (nothing is stored)
    reused: bool


def profile_fingerprint(profile: Profile) -> str:
    text = json.dumps(profile.to_dict(), sort_keys=True, allow_nan=False)
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def plan_key(
    graph: Graph,
    profile: Profile,
    devices: Sequence[str],
    budgets: Mapping[str, str | int],
    method: str,
    time_limit: float | None,
    stores: Sequence[str] = (),
    homes: Mapping[str, str] | None = None,
    gap: float | None = None,
) -> str:
    parts = {
        "graph": graph.fingerprint,
        "profile": profile_fingerprint(profile),
        "devices": list(devices),
        "budgets": {d: str(b) for d, b in budgets.items()},
        "method": method,
        "time_limit_s": time_limit if time_limit is not None else DEFAULT_TIME_LIMIT_S,
    }
    if stores or homes:  # absent otherwise, so the plans cached before stores and homes keep their keys
        parts["stores"] = sorted(stores)
        parts["homes"] = dict(sorted((homes or {}).items()))
    if gap is not None:  # likewise: a plan solved to another gap may differ
        parts["gap"] = gap
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def plan_path(cache_dir: str | Path, graph: Graph, key: str) -> Path:
    name = f"{graph.name or 'graph'}-{graph.fingerprint[:12]}-{key}.json".replace("/", "_").replace(":", "_")
    return Path(cache_dir) / "plans" / name


def _reuse(path: Path, graph: Graph, profile: Profile, key: str) -> Plan:
    """The cached plan at `path` if it is this key's and the simulator accepts it, else a PlanError saying why."""
    plan = Plan.load(path)
    if plan.extra.get(KEY_FIELD) != key or plan.graph != graph.fingerprint:
        raise PlanError("it was made for another graph, profile, devices or budgets", stage="train")
    simulate(graph, plan, profile)  # the one oracle: an invalid or over-budget plan raises here
    return plan


def cached_plan(
    graph: Graph,
    budgets: Mapping[str, str | int],
    devices: Sequence[str],
    method: str = "auto",
    profile: str = "measure",
    time_limit: float | None = None,
    cache_dir: str | Path = "profiles",
    notice: Callable[[str], None] = print,
    stores: Sequence[str] = (),
    homes: Mapping[str, str] | None = None,
    fused: bool = False,
    gap: float | None = None,
) -> CachedPlan:
    """The plan for `graph` on `devices` within `budgets`: the cached one when its key matches and it simulates,
    else solved (`method`, within `time_limit` s) on the stored or freshly measured profile, and cached. `stores`
    run no op (only their copies are costed); `homes` places graph inputs (default: the first device); `fused`: the
    plan runs as compiled regions, its costs priced as fused (and keyed so: the profile's numbers differ); `gap`: the
    solver stops once its plan is within this relative gap of the lower bound on every plan (default SolverOptions')."""
    from xsched.solve.api import solve
    from xsched.solve.options import SolverOptions

    devices = list(devices)
    compute = [d for d in devices if d not in stores]
    measured = stored_profile(graph, compute, cache_dir, stores) if profile == "measure" else profile
    costs = plan_profile(graph, devices, measured, cache_dir, stores, fused=fused)
    check_runnable(graph, costs, compute)  # an op no device runs: one line naming its operator and why
    stored = profile_path(graph, compute, cache_dir, stores) if profile == "measure" else None
    key = plan_key(graph, costs, devices, budgets, method, time_limit, stores, homes, gap)
    path = plan_path(cache_dir, graph, key)
    if path.exists():
        try:
            return CachedPlan(_reuse(path, graph, costs, key), costs, path, stored, reused=True)
        except XschedError as e:
            notice(f"plan cache {path} is stale or unreadable: {e.detail[:160]}; planning again")
    options = SolverOptions(time_limit_s=time_limit if time_limit is not None else DEFAULT_TIME_LIMIT_S)
    if gap is not None:
        options = dataclasses.replace(options, mip_gap=gap)
    try:
        plan = solve(graph, costs, budgets, devices, method=method, options=options, homes=homes)
    except BudgetError as e:
        if "below the lower bound" in e.detail and "proven" not in e.detail:  # say it: no method can plan this
            where = {"op": e.op, "value": e.value, "device": e.device}
            raise BudgetError(f"no plan can exist, proven: {e.detail}", stage=e.stage, **where) from e
        raise
    plan = dataclasses.replace(plan, extra={**plan.extra, KEY_FIELD: key})
    text = json.dumps(plan.to_dict(), indent=1) + "\n"
    atomic_write(path, lambda f: f.write(text.encode()))
    return CachedPlan(plan, costs, path, stored, reused=False)
