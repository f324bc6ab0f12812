"""A lower bound on every plan's makespan: what the devices must compute and what the links must move, whatever the
plan. The runner measures its gap against it; `xsched plan --explain` and the report show it."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from xsched.contracts.graph import Graph
from xsched.contracts.plan import required_homes
from xsched.contracts.profile import Profile
from xsched.solve.bounds.chains import Chains, chains
from xsched.solve.bounds.phases import phase_bound


@dataclass(frozen=True)
class TimeBound:
    """No plan's makespan is below `seconds`; `by` names what sets it ("critical path", "compute on <device>",
    "compute spread over N devices", "link <src>-><dst>") and `why` says it in words."""

    seconds: float
    by: str
    why: str


def time_bounds(
    graph: Graph,
    profile: Profile,
    devices: Sequence[str],
    homes: Mapping[str, str],
    budgets: Mapping[str, int] | None = None,
) -> list[TimeBound]:
    """Every bound that holds (largest first):
    - the critical path: the longest chain of ops, each on its best device, copies at their links' time;
    - per device, the ops that no other device could run without making the step longer than the bound (those that
      run only there, and those whose chain through them elsewhere would be longer), one after another on its one
      compute lane;
    - every op at its cheapest, spread perfectly over the devices that compute;
    - per link, the bytes that must cross it (a graph input read only by ops that cannot run on its home, an
      output that must end on a home where its producer cannot run) at its bandwidth, each copy with its latency;
    - the phases around the cut op (`bounds.phases`): the ops before it and the copies they need before it first
      runs, the ops after it after, and under `budgets` (bytes) what is not held then moved or computed again."""
    runs_on = {o.id: [d for d in devices if profile.can_run(o.id, d)] for o in graph.ops}
    ways = chains(graph, profile, devices, homes)
    cheapest = {o.id: min(ways.time[d][o.id] for d in devices) for o in graph.ops}  # 0 where no device runs it
    bounds = [_critical_path(graph, ways, devices), *_kept_on_device(graph, ways, devices)]
    computing = [d for d in devices if profile.compute.get(d)]
    if len(computing) > 1:
        total = sum(cheapest.values()) / len(computing)
        why = f"every op at its cheapest, spread evenly over the {len(computing)} devices that compute"
        bounds.append(TimeBound(total, f"compute spread over {len(computing)} devices", why))
    bounds += _links(graph, profile, devices, homes, runs_on)
    phased = phase_bound(graph, profile, devices, homes, budgets or {})
    if phased is not None:
        seconds, cut = phased
        why = (
            f"the {len(cut.before)} ops before {cut.op} and the copies they need, then the {len(cut.after)} after it;"
            f" what is not held at {cut.op} under the budgets moved or computed again (a linear relaxation)"
        )
        bounds.append(TimeBound(seconds, f"phases around {cut.op}", why))
    return sorted(bounds, key=lambda b: -b.seconds)


def time_bound(
    graph: Graph,
    profile: Profile,
    devices: Sequence[str],
    homes: Mapping[str, str],
    budgets: Mapping[str, int] | None = None,
) -> TimeBound:
    """The largest of `time_bounds`."""
    return time_bounds(graph, profile, devices, homes, budgets)[0]


def _critical_path(graph: Graph, ways: Chains, devices: Sequence[str]) -> TimeBound:
    """The longest chain through any op on its best device, copies at their links' time (`bounds.chains`)."""
    spans = (min(ways.through(o.id, d) for d in devices) for o in graph.ops)
    longest = max((t for t in spans if math.isfinite(t)), default=0.0)
    why = f"the longest chain of ops, each on its best device, copies at their links' time: {longest:.6g} s"
    return TimeBound(longest, "critical path", why)


def _kept_on_device(graph: Graph, ways: Chains, devices: Sequence[str]) -> list[TimeBound]:
    """Per device d, the least T with T >= the time d must compute in any plan whose step is at most T. An op must
    run on d in such a plan where on every other device its chain (`Chains.through`) is longer than T: d runs those
    ops one after another."""
    out = []
    for d in devices:
        rows = []  # (the shortest step with the op elsewhere, its time on d)
        for o in graph.ops:
            if math.isfinite(ways.time[d][o.id]):
                elsewhere = min((ways.through(o.id, e) for e in devices if e != d), default=math.inf)
                rows.append((elsewhere, ways.time[d][o.id]))
        seconds, n = _least_fixed_point(rows)
        if n:
            why = f"{n} ops no other device can run within {seconds:.6g} s run on {d} one after another"
            out.append(TimeBound(seconds, f"compute on {d}", why))
    return out


def _least_fixed_point(rows: list[tuple[float, float]]) -> tuple[float, int]:
    """The least T >= the sum of the times of the rows whose threshold is above T, and how many those are. The sum
    only falls as T passes thresholds, so the answer lies in the first interval between them that holds it."""
    rows = sorted(rows)
    left = sum(t for _, t in rows)  # the rows above the current interval's start
    start = 0.0
    for k, (threshold, t) in enumerate(rows):
        if max(left, start) < threshold:
            return max(left, start), len(rows) - k
        left, start = left - t, threshold
    return start, 0


def _links(graph, profile, devices, homes, runs_on) -> list[TimeBound]:
    """Per ordered device pair, the seconds the values that must cross it take (only where no third device could
    relay them)."""
    must: dict[tuple[str, str], list[str]] = {}
    for v in graph.inputs:
        home = homes.get(v)
        readers = graph.consumers.get(v, ())
        if home is None or not readers:
            continue
        places = {d for r in readers for d in runs_on[r]}
        if home not in places and len(places) == 1:
            must.setdefault((home, next(iter(places))), []).append(v)
    for v, home in required_homes(graph, homes).items():
        p = graph.producer.get(v)
        if p is not None and home not in runs_on[p] and len(runs_on[p]) == 1:
            must.setdefault((runs_on[p][0], home), []).append(v)
    relays = {
        (a, b) for a, b in must if any(c not in (a, b) and profile.link(a, c) and profile.link(c, b) for c in devices)
    }
    out = []
    for (a, b), values in must.items():
        if (a, b) in relays or profile.link(a, b) is None or a not in devices or b not in devices:
            continue  # another route exists (the bytes may cross two other links), or none at all
        secs = sum(profile.copy_time(v, graph.value[v].nbytes, a, b) or 0.0 for v in values)
        why = f"{len(values)} values must move {a}->{b}: {secs:.6g} s at its measured speed"
        out.append(TimeBound(secs, f"link {a}->{b}", why))
    return out
