"""How `wrap` gets its plan: the costs (measured once per graph, devices and machine and cached under profiles/, or
modelled), the solve (`auto` by default, within a time limit), and the plan's one-screen report."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from xsched.budgets import format_bytes
from xsched.contracts.graph import Graph
from xsched.contracts.plan import Compute, Copy, Plan
from xsched.contracts.profile import Profile
from xsched.contracts.result import RunStats
from xsched.errors import XschedError
from xsched.profiling.fused import fused_profile
from xsched.profiling.measure import check_runnable, profile_graph
from xsched.profiling.model import cost_profile
from xsched.profiling.store import default_profile_path, load_profile, save_profile

PROFILE_MODES = ("measure", "model")
# Plan.extra of a compiled plan after its first run: the solver's per-op peak count (the predicted peak is then
# the compiled regions' measured one, xsched.execute.compiled_memory)
PER_OP_KEY = "per_op_peak_bytes"
DEFAULT_TIME_LIMIT_S = 60.0


def profile_path(
    graph: Graph, devices: Sequence[str], profile_dir: str | Path | None = None, stores: Sequence[str] = ()
) -> Path:
    """Where `xsched profile` stores the graph's profile on `devices` with `stores`
    (profiles/<graph>-<fingerprint>-<devices>[_store-<stores>].json), or the same file name under `profile_dir`."""
    path = default_profile_path(graph, list(devices), list(stores))
    return Path(profile_dir) / path.name if profile_dir is not None else path


def measured_profile(
    graph: Graph,
    devices: Sequence[str],
    profile_dir: str | Path | None = None,
    stores: Sequence[str] = (),
    measure: Callable[..., Profile] | None = None,
) -> Profile:
    """The stored profile of `graph` on `devices` (ops measured) and `stores` (copies only) if it was measured on
    this machine (same torch, same device fingerprints), else a fresh measurement by `measure` (default
    profile_graph; execute.back_to_back.profile_calibrated adds the back-to-back calibration), saved where
    `xsched profile` would save it."""
    path = profile_path(graph, devices, profile_dir, stores)
    if path.exists():  # stale (other machine or torch) or corrupt: measured again and overwritten
        stale = {"stores": list(stores), "measure": measure, "progress": False}
        return load_profile(path, graph, [*devices, *stores], reprofile=True, **stale)
    fresh = (measure or profile_graph)(graph, list(devices), stores=list(stores), progress=False)
    save_profile(fresh, path)
    return fresh


def plan_profile(
    graph: Graph,
    devices: Sequence[str],
    profile: Profile | str,
    profile_dir: str | Path | None = None,
    stores: Sequence[str] = (),
    fused: bool = False,
) -> Profile:
    """The costs to plan `graph` with: a given Profile for its own graph, else measured ("measure", cached) or
    modelled ("model"); a given Profile of another graph (a new input shape) falls back to measuring. `stores`
    (named in `devices` or not) hold values and run no op: only their copies are measured or modelled. `fused`
    (a plan run as compiled regions): each computing device's ops priced as compiled (`fused_profile`: a fusible
    op costs nothing, its work is in its consumer's kernel), so recomputing a fusible chain is seen as free."""
    stores = list(dict.fromkeys(stores))
    compute = [d for d in devices if d not in stores]
    costs = _costs(graph, compute, profile, profile_dir, stores)
    if fused:
        for d in compute:
            if d in costs.compute:
                costs = fused_profile(graph, costs, d)
    return costs


def _costs(
    graph: Graph, compute: list[str], profile: Profile | str, profile_dir: str | Path | None, stores: list[str]
) -> Profile:
    if isinstance(profile, Profile):
        if profile.graph == graph.fingerprint:
            return profile
        profile = "measure"
    if profile == "model":
        return cost_profile(graph, compute, stores)
    if profile == "measure":
        return measured_profile(graph, compute, profile_dir, stores)
    raise XschedError(f"profile must be a Profile or one of {PROFILE_MODES}, got {profile!r}", stage="execute")


def solve_plan(
    graph: Graph,
    budgets: Mapping[str, str | int],
    devices: Sequence[str] | None = None,
    method: str = "auto",
    profile: Profile | str = "model",
    time_limit: float | None = None,
    profile_dir: str | Path | None = None,
    stores: Sequence[str] = (),
    homes: Mapping[str, str] | None = None,
    compile: bool = False,
) -> Plan:
    """A plan for `graph` within `budgets` by `method` (default "auto": bounds, heuristics, then the exact solvers
    within `time_limit` seconds, default 60) on the costs `plan_profile` gives (`stores`: devices that run no op);
    `homes`: where graph inputs live (default: the first device); `compile`: the plan runs as compiled regions, so
    its costs are priced as fused."""
    from xsched.solve.api import solve
    from xsched.solve.options import SolverOptions

    devices = list(devices) if devices is not None else list(budgets)
    if not devices:
        raise XschedError("wrap needs devices: give budgets per device or devices", stage="execute")
    costs = plan_profile(graph, devices, profile, profile_dir, stores, fused=compile)
    check_runnable(graph, costs, [d for d in devices if d not in stores])  # an unsupported op: one line, named
    options = SolverOptions(time_limit_s=time_limit if time_limit is not None else DEFAULT_TIME_LIMIT_S)
    return solve(graph, costs, budgets, devices, method=method, options=options, homes=homes)


def plan_report(graph: Graph, plan: Plan) -> str:
    """A few lines: how the plan was found (method, status, gap), its predicted time and peaks against the
    budgets, and what it does beyond eager (recomputes, copies)."""
    s = plan.solver
    gap = f", gap {s.gap:.2%}" if s.gap is not None else ""
    found = f" (found by {s.found_by})" if s.found_by != s.method else ""
    lines = [
        f"{graph.name or 'graph'}: {len(graph.ops)} ops; plan by {s.method}{found}: {s.status}{gap}, {s.solve_s:.2f} s"
    ]
    p = plan.predicted
    if p is not None:
        lines.append(f"  predicted time {p.time_s * 1e3:.3f} ms" if p.time_s is not None else "  predicted time: n/a")
        for d, peak in p.peak_bytes.items():
            budget = plan.budgets.get(d)
            of = f" of {format_bytes(budget)} ({peak / budget:.0%})" if budget else " (no budget)"
            lines.append(f"  {d}: peak {format_bytes(peak)}{of}")
    per_op = plan.extra.get(PER_OP_KEY)
    if per_op:
        counted = ", ".join(f"{d} {format_bytes(b)}" for d, b in per_op.items())
        lines.append(f"  peaks of the compiled regions as measured on the first run; per op: {counted}")
    computes = sum(isinstance(x, Compute) for x in plan.steps)
    copies = sum(isinstance(x, Copy) for x in plan.steps)
    lines.append(f"  {computes - len(graph.ops)} recomputes, {copies} copies, {len(plan.steps)} steps")
    if isinstance(s.stats, RunStats) and s.stats.bound_source:
        lines.append(f"  lower bound: {s.stats.bound_source}")
    return "\n".join(lines)
