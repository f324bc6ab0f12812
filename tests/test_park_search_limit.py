"""park-search keeps the run's limit (issue 33): with a plan in hand it starts no run of the park greedy where the
run's time left is shorter than what one takes (the median of those timed earlier in the run), stops its first at
the run's limit and later ones at its own deadline; park stops its variants after the first at its deadline too.
The clock is a fake one that the greedy's work advances, so nothing here measures wall time."""

from __future__ import annotations

import pytest
from test_time_limit import FakeClock, problem

from xsched.solve.heuristics import park
from xsched.solve.heuristics.park_search import park_search
from xsched.solve.options import SolverOptions, deadline, note_unit, one_run, run_left, unit_s, using_clock
from xsched.solve.runner import GRACE_S, GRACE_SHARE, Configuration, run

pytestmark = pytest.mark.usefixtures("one_thread")


def costing(monkeypatch, clock: FakeClock, name: str, seconds: float) -> list[int]:
    """park's `name` (park_computes: a run of the greedy; _best_move: one move of it) advances the clock by
    `seconds` at each call; the calls are counted."""
    original, calls = getattr(park, name), [0]

    def costly(*a, **k):
        calls[0] += 1
        clock.t += seconds
        return original(*a, **k)

    monkeypatch.setattr(park, name, costly)
    return calls


def test_a_run_keeps_its_end_and_the_median_unit_of_each_kind() -> None:
    note_unit("park", 3.0)  # outside a run: nothing kept
    assert unit_s("park") == 0.0
    with using_clock(FakeClock(1.0)):
        with deadline(2.0):  # outside a run, its end is the innermost deadline's
            assert run_left() <= 2.0
        with one_run(10.0), deadline(2.0):
            for seconds in (3.0, 1.0, 8.0):
                note_unit("park", seconds)
            assert unit_s("park") == 3.0 and unit_s("other") == 0.0 and 2.0 < run_left() < 10.0
        assert unit_s("park") == 0.0


def test_the_runner_does_not_start_park_search_with_less_left_than_a_greedy_run(monkeypatch) -> None:
    """Each run of the greedy takes 5 s of a 12 s limit: park makes two (a third, as long, would end past its
    share), and park-search, left 2 s with park's plan in hand, does not start one that would end at 15 s, past
    the limit x 1.1 + 1 s; the run returns park's plan at 10 s."""
    clock = FakeClock(0.0)
    runs = costing(monkeypatch, clock, "park_computes", 5.0)
    p = problem()
    with using_clock(clock):
        r = run(p, Configuration("test", ("park", "park-search")), SolverOptions(time_limit_s=12.0))
    outcomes = {o.method: o for o in r.record.stats.members}
    assert runs[0] == 2 and clock.t == pytest.approx(10.0), (runs, clock.t)
    assert clock.t <= 12.0 * (1 + GRACE_SHARE) + GRACE_S
    assert outcomes["park-search"].status == "no_incumbent"
    assert "takes 5.00 s in this solve, 2.00 s left" in outcomes["park-search"].message
    assert r.plan is not None and r.record.stats.found_by == "park"


def test_park_search_with_a_warm_start_stops_a_greedy_run_at_its_deadline(monkeypatch) -> None:
    """Each move of the greedy takes 1 s; park-search's first run makes about ten. With a warm start and 3 s it
    stops that run after its third move and returns no plan of its own; without a warm start its first run is made
    whole (the caller would have no plan otherwise), and no other."""
    p = problem()
    warm = park.park_remat(p, SolverOptions(time_limit_s=None))
    clock = FakeClock(0.0)
    moves = costing(monkeypatch, clock, "_best_move", 1.0)
    with using_clock(clock), deadline(3.0):
        r = park_search(p, SolverOptions(time_limit_s=None), warm)
    assert moves[0] == 3 and clock.t == pytest.approx(3.0), (moves, clock.t)
    assert r.plan is None and r.status == "no_incumbent"
    with using_clock(clock), deadline(3.0):
        alone = park_search(p, SolverOptions(time_limit_s=None), None)
    assert moves[0] >= 3 + 8 and "(1 tried)" in alone.message, (moves, alone.message)


def test_park_searchs_first_run_may_pass_its_own_deadline_but_not_the_runs(monkeypatch) -> None:
    """Each move of the greedy takes 1 s. Within a run ending at 5 s, park-search's own deadline at 2 s does not cut
    its first run short (cut short it gives nothing): the run's limit does, at 5 s; no other run is started."""
    p = problem()
    warm = park.park_remat(p, SolverOptions(time_limit_s=None))
    clock = FakeClock(0.0)
    moves = costing(monkeypatch, clock, "_best_move", 1.0)
    with using_clock(clock), one_run(5.0), deadline(2.0):
        r = park_search(p, SolverOptions(time_limit_s=None), warm)
    assert moves[0] == 5 and clock.t == pytest.approx(5.0) and r.plan is None, (moves, clock.t)


def test_park_stops_a_later_variant_part_way_at_its_deadline(monkeypatch) -> None:
    """The k-th run of the greedy takes k s a move: the first (8 moves) ends at 8 s of a 20 s limit, the second is
    started (12 s left, more than the 8 s the first took) and would end at 24 s; it is stopped at 20 s, and the
    first's plan is returned."""
    p = problem()
    clock, moves, runs = FakeClock(0.0), [], [0]
    best_move, computes = park._best_move, park.park_computes

    def counted_run(*a, **k):
        runs[0] += 1
        return computes(*a, **k)

    def slower_each_run(*a, **k):
        moves.append(runs[0])
        clock.t += runs[0]
        return best_move(*a, **k)

    monkeypatch.setattr(park, "park_computes", counted_run)
    monkeypatch.setattr(park, "_best_move", slower_each_run)
    with using_clock(clock):
        plan = park.park_remat(p, SolverOptions(time_limit_s=20.0))
    assert moves.count(1) == 8 and runs[0] == 2 and clock.t == pytest.approx(20.0), (moves, clock.t)
    assert plan.solver.stats.recomputes + plan.solver.stats.parked > 0
