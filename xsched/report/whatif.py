"""Device what-ifs: one graph planned for several machines (e.g. this CPU + an A100-40GB, + an RTX 4090, + two
L4s) from one profile: each machine at its base budgets, and its time against the budget of its accelerators."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from xsched.contracts.graph import Graph
from xsched.contracts.profile import Profile
from xsched.report.machines import Machine, accelerators, base_budgets, cost_source, energy_label, restrict
from xsched.report.sweep import Point, Sweep, SweepSettings, plan_point, point_of, sweep

Sweeps = dict[tuple[str, tuple[str, ...]], Sweep]  # (machine label, swept devices) -> sweep: computed once


@dataclass(frozen=True)
class MachineResult:
    """One machine: its budgets (bytes), where each device's costs come from, its plans at those budgets (the
    sweep's method and the baselines) and its sweep over the accelerators' budget."""

    machine: Machine
    budgets: Mapping[str, int]
    sources: Mapping[str, str]
    energy: str
    points: tuple[Point, ...]
    sweep: Sweep

    @property
    def best(self) -> Point | None:
        """The fastest plan at the base budgets, if any."""
        return min((p for p in self.points if p.ok), key=lambda p: p.step_s or 0.0, default=None)


def machine_sweep(
    graph: Graph,
    profile: Profile,
    machine: Machine,
    swept: Sequence[str],
    eager_peak: int,
    settings: SweepSettings,
    cache: Sweeps,
    tick: Callable[[], None] = lambda: None,
) -> Sweep:
    """The sweep of `swept` on `machine` (profile: the full one), computed once per (machine, swept)."""
    key = (machine.label, tuple(swept))
    if key not in cache:
        sub = restrict(profile, machine.devices)
        base = base_budgets(machine, sub, eager_peak)
        cache[key] = sweep(graph, sub, machine, swept, base, eager_peak, settings, tick)
    return cache[key]


def device_whatif(
    graph: Graph,
    profile: Profile,
    machines: Sequence[Machine],
    eager_peak: int,
    settings: SweepSettings,
    cache: Sweeps,
    tick: Callable[[], None] = lambda: None,
) -> list[MachineResult]:
    """Every machine at its base budgets and swept over its accelerators' budget (all of them together)."""
    out = []
    for m in machines:
        sub = restrict(profile, m.devices)
        base = base_budgets(m, sub, eager_peak)
        points = []
        for method in settings.methods:
            result = plan_point(graph, sub, m, base, method, settings.options())
            points.append(point_of(m, "base budgets", 0, method, base, result, graph, sub))
            tick()
        s = machine_sweep(graph, profile, m, accelerators(sub, m), eager_peak, settings, cache, tick)
        sources = {d: cost_source(sub, d) for d in m.devices}
        out.append(MachineResult(m, base, sources, energy_label(sub, m.devices), tuple(points), s))
    return out
