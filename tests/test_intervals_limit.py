"""The CP-SAT interval members keep their deadline (issue 33): the model's data and CP-SAT's model stop building at
it, CP-SAT searches only the time left after the build, the replay of its solutions stops there once one plan is
kept, and a large graph's first order in `order-cpsat` gets the whole limit. The clock is a fake one, advanced by
the work itself, so nothing here measures wall time."""

from __future__ import annotations

import pytest
from ortools.sat.python import cp_model
from test_time_limit import FakeClock, problem

from xsched.errors import NoIncumbent
from xsched.solve.heuristics import park
from xsched.solve.intervals import data as interval_data
from xsched.solve.intervals import solver as interval_solver
from xsched.solve.intervals.cpsat import REPLAY_SHARE, solve_cpsat
from xsched.solve.intervals.data import Late, build_data
from xsched.solve.intervals.extract import hint_from_plan
from xsched.solve.intervals.solver import solve_intervals
from xsched.solve.options import SolverOptions, using_clock
from xsched.solve.order.order import first_compute_indices, search_order

pytestmark = pytest.mark.usefixtures("one_thread")


def searches(monkeypatch) -> list[float]:
    """CP-SAT's searches (not the hint's completion) are recorded by their time limit and not run (NoIncumbent)."""
    limits: list[float] = []
    original = cp_model.CpSolver.Solve

    def recorded(self, model, callback=None):
        if self.parameters.fix_variables_to_their_hinted_value:
            return original(self, model)
        limits.append(self.parameters.max_time_in_seconds)
        return cp_model.UNKNOWN

    monkeypatch.setattr(cp_model.CpSolver, "Solve", recorded)
    return limits


def data_of(p, order=None):
    order = range(len(p.graph.ops)) if order is None else order
    return build_data(p.graph, p.profile, p.budgets, tuple(p.devices), p.homes, order, 2)


def test_the_data_stops_building_at_the_deadline(monkeypatch) -> None:
    """A clock that advances 0.1 s each time it is read, read at every op, value and slot: 2 s in, build_data
    stops, and intervals-cpsat gives no plan without building a CP-SAT model."""
    monkeypatch.setattr(interval_data, "CHECK_EVERY", 1)
    models = []
    monkeypatch.setattr(interval_solver, "solve_cpsat", lambda *a, **k: models.append(a))
    p = problem()
    clock = FakeClock(0.1)
    with using_clock(clock), pytest.raises(NoIncumbent, match="found no plan"):
        solve_intervals(p, SolverOptions(time_limit_s=2.0))
    assert not models and clock.t <= 2.0 + 0.3, clock.t
    with pytest.raises(Late):
        build_data(
            p.graph, p.profile, p.budgets, tuple(p.devices), p.homes, range(len(p.graph.ops)), 2, late=lambda: True
        )
    assert data_of(p).slots  # no deadline: built whole


def test_the_cpsat_model_stops_building_at_the_deadline(monkeypatch) -> None:
    """The same clock read within CP-SAT's model build: past the limit it stops without searching, where without
    the clock's pressure it searches."""
    limits = searches(monkeypatch)
    data = data_of(problem())
    monkeypatch.setattr(interval_data, "CHECK_EVERY", 1)
    clock = FakeClock(0.1)
    with using_clock(clock):
        out = solve_cpsat(data, 1.0, workers=1)
    assert out.status == "unknown" and out.placed is None and not limits
    assert clock.t <= 1.0 + 0.3, clock.t
    with using_clock(FakeClock(0.0)):
        solve_cpsat(data, 1.0, workers=1)
    assert limits == [pytest.approx((1 - REPLAY_SHARE) * 1.0)]


def test_cpsat_searches_the_time_left_after_its_build(monkeypatch) -> None:
    """A 10 s limit, a build that takes 4 s of the clock (0.01 s at each look): CP-SAT's search gets what is left
    less the replay's share, not the whole limit."""
    limits = searches(monkeypatch)
    p = problem()
    data = data_of(p)
    monkeypatch.setattr(interval_data, "CHECK_EVERY", 1)
    clock = FakeClock(0.0)
    original = interval_data.check

    def slow(late, count):
        clock.t += 0.01
        original(late, count)

    monkeypatch.setattr("xsched.solve.intervals.cpsat.check", slow)
    with using_clock(clock):
        solve_cpsat(data, 10.0, workers=1)
    built = clock.t
    assert 0.0 < built < 10.0 and limits == [pytest.approx((1 - REPLAY_SHARE) * (10.0 - built), abs=0.02)], (
        built,
        limits,
    )


def test_the_replay_of_solutions_stops_at_the_deadline_once_a_plan_is_kept(monkeypatch) -> None:
    """CP-SAT returns its plan and three earlier ones (park's, as a placement); each replay takes 1 s of a 0.5 s
    limit: the first is kept, the rest are not replayed."""
    p = problem()
    warm = park.park_remat(p, SolverOptions(time_limit_s=10.0))
    data = data_of(p, first_compute_indices(p.graph, warm))
    placed = hint_from_plan(data, warm)
    assert placed
    found = interval_solver.Outcome("feasible", placed, 10, None, 0.0, 0.0, ((11, placed), (12, placed), (13, placed)))
    monkeypatch.setattr(interval_solver, "solve_cpsat", lambda *a, **k: found)
    clock, replays = FakeClock(0.0), []
    original = interval_solver.to_plan

    def slow(*a, **k):
        replays.append(clock.t)
        clock.t += 1.0
        return original(*a, **k)

    monkeypatch.setattr(interval_solver, "to_plan", slow)
    with using_clock(clock):
        plan = solve_intervals(p, SolverOptions(time_limit_s=0.5), warm, c_max=2)
    assert plan.predicted is not None and len(replays) == 1, replays
    replays.clear()
    with using_clock(FakeClock(0.0)):  # with time left, every solution is replayed
        solve_intervals(p, SolverOptions(time_limit_s=100.0), warm, c_max=2)
    assert len(replays) == 4, replays


def test_a_first_order_scored_alone_gets_the_whole_limit() -> None:
    """order-cpsat on a large graph stops when its first order gives no plan (give_up=1): that order is scored with
    all the time, not a share the scorer would now keep."""
    p = problem()
    asked: list[float] = []

    def score(order, seconds):
        asked.append(seconds)
        raise NoIncumbent("none")

    search_order(p.graph, score, 20.0, give_up=1, first_whole=True)
    assert len(asked) == 1 and asked[0] > 19.0, asked
    asked.clear()
    search_order(p.graph, score, 20.0, give_up=1)
    assert len(asked) == 1 and asked[0] < 10.0, asked
