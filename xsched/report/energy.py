"""Energy what-ifs on one machine: time against energy as the objective's energy weight grows (time + alpha x
energy), and the fastest plan under each of several energy caps."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from xsched.contracts.graph import Graph
from xsched.contracts.profile import Profile
from xsched.report.machines import Machine, energy_label
from xsched.report.sweep import PlanTimes, SweepSettings, found_by, plan_point

# alpha as multiples of (time / energy of the fastest plan): at 1, a joule saved is worth as much as the same
# share of the time; 0 is the fastest plan
ALPHA_FACTORS = (0.0, 0.1, 0.3, 1.0, 3.0, 10.0, 100.0)
CAPS = 5  # energy caps from the least energy seen to the fastest plan's energy
BELOW = 0.9  # one more cap at this share of the least energy seen: where plans run out


@dataclass(frozen=True)
class EnergyPoint(PlanTimes):
    """One plan of the study: `kind` "alpha" (objective time + alpha x energy, alpha in s/J) or "cap" (the fastest
    plan with energy_j <= cap_j); no plan: time_s None, `status` and `note` say why."""

    kind: str
    alpha: float
    cap_j: float | None
    status: str
    time_s: float | None = None
    makespan_s: float | None = None
    energy_j: float | None = None
    found_by: str | None = None
    note: str = ""


@dataclass(frozen=True)
class EnergyStudy:
    """The points for one machine under fixed budgets; `source` says whether energy is measured or modelled."""

    machine: str
    budgets: Mapping[str, int]
    method: str
    source: str
    alpha_unit: float  # s/J: the fastest plan's time over its energy
    points: tuple[EnergyPoint, ...]


def energy_method(settings: SweepSettings) -> str:
    """The sweep's method when it weighs energy (an exact solver or auto); heuristics minimise time only: auto."""
    from xsched.solve.registry import SOLVERS

    entry = SOLVERS.get(settings.method)
    return "auto" if entry is not None and entry.kind == "heuristic" else settings.method


def energy_study(
    graph: Graph,
    profile: Profile,
    machine: Machine,
    budgets: Mapping[str, int],
    settings: SweepSettings,
    tick: Callable[[], None] = lambda: None,
    factors: Sequence[float] = ALPHA_FACTORS,
    caps: int = CAPS,
) -> EnergyStudy:
    """Alpha from 0 up (`factors` x the fastest plan's time/energy), then the fastest plan under `caps` caps
    between the least energy the alphas reached and the fastest plan's energy, and one cap below that."""
    method = energy_method(settings)
    source = energy_label(profile, machine.devices)

    def point(kind: str, alpha: float, cap: float | None) -> EnergyPoint:
        plan, status, note = plan_point(
            graph, profile, machine, budgets, method, settings.options(alpha_energy=alpha, energy_cap_j=cap)
        )
        tick()
        if plan is None:
            return EnergyPoint(kind, alpha, cap, status, note=note)
        p = plan.predicted
        return EnergyPoint(kind, alpha, cap, status, p.time_s, p.makespan_s, p.energy_j, found_by(plan, method))

    fastest = point("alpha", 0.0, None)
    points = [fastest]
    if not fastest.ok or not fastest.energy_j:
        return EnergyStudy(machine.label, dict(budgets), method, source, 0.0, tuple(points))
    unit = fastest.step_s / fastest.energy_j
    points += [point("alpha", f * unit, None) for f in factors if f > 0]
    least = min(p.energy_j for p in points if p.ok)
    top = fastest.energy_j
    n = max(caps, 2)
    limits = [least + (top - least) * k / (n - 1) for k in range(n)] if top > least * (1 + 1e-9) else [top]
    points += [point("cap", 0.0, c) for c in [least * BELOW, *limits]]
    return EnergyStudy(machine.label, dict(budgets), method, source, unit, tuple(points))


def count(factors: Sequence[float] = ALPHA_FACTORS, caps: int = CAPS) -> int:
    """Solves one study makes at most (for progress bars)."""
    return len(factors) + max(caps, 2) + 1


def tradeoff(study: EnergyStudy) -> str:
    """In words: whether any plan found trades time for energy."""
    ok = [p for p in study.points if p.ok]
    if not ok:
        return "no plan found"
    fastest = min(ok, key=lambda p: (p.step_s, p.energy_j))
    frugal = min(ok, key=lambda p: (p.energy_j, p.step_s))
    if frugal.energy_j >= fastest.energy_j * (1 - 1e-9):
        return "the fastest plan found also uses the least energy: no trade-off"
    saved = 1 - frugal.energy_j / fastest.energy_j
    slower = frugal.step_s / fastest.step_s - 1
    return f"up to {saved:.0%} less energy for {slower:.0%} more time"
