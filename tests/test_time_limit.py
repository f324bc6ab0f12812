"""The runner keeps its time limit (xsched.solve.options' clock): every heuristic stops starting variants past its
deadline, the runner gives each member what is left, and `solve` returns the best plan so far with its gap. The
clock is a fake one that advances as it is read, so nothing here measures wall time (scripts/bench_time_limit.py
does)."""

from __future__ import annotations

import itertools

import pytest
from test_offload import fwd_bwd
from test_park import DEVICES, with_store

from xsched.errors import NoIncumbent, XschedError
from xsched.solve.api import solve_result
from xsched.solve.heuristics import checkpoint, gaps, offload, park
from xsched.solve.options import SolverOptions, deadline, now, out_of_time, past_deadline, time_left, using_clock
from xsched.solve.problem import Problem
from xsched.solve.reference import eager_peak

pytestmark = pytest.mark.usefixtures("one_thread")


class FakeClock:
    """Seconds that advance by `step` at each read: a member that reads the clock in a loop runs out of time."""

    def __init__(self, step: float) -> None:
        self.t, self.step, self.reads = 0.0, step, 0

    def __call__(self) -> float:
        self.t += self.step
        self.reads += 1
        return self.t


def problem(n: int = 10) -> Problem:
    g = fwd_bwd(n)
    return Problem.make(g, with_store(g, bandwidth=30.0), {"cpu:0": eager_peak(g) // 2}, DEVICES, {"x": "cpu:0"})


def test_deadlines_nest_and_the_clock_can_be_swapped() -> None:
    with using_clock(FakeClock(1.0)):
        assert time_left() == float("inf") and not out_of_time()
        with deadline(5.0) as granted:
            assert 3.0 <= granted <= 5.0
            with deadline(100.0) as inner:  # an inner deadline never outlasts the enclosing one
                assert inner <= granted
            while not out_of_time():
                pass
            assert now() >= 5.0
        assert not out_of_time()


# each heuristic's unit of work: what it would repeat for every variant if the clock did not stop it
WORK = {
    "park": (park, "park_line"),
    "gaps": (gaps, "gap_computes"),
    "offload": (offload, "_fit_order"),
    "checkpoint": (checkpoint, "checkpoint_computes"),
}
HEURISTICS = {
    "park": park.park_remat,
    "gaps": gaps.gap_remat,
    "offload": offload.offload_search,
    "checkpoint": checkpoint.checkpoint_search,
}


@pytest.mark.parametrize("name", sorted(WORK))
def test_a_heuristic_past_its_deadline_runs_only_its_first_variant(name: str, monkeypatch) -> None:
    """The limit comes from the heuristic's own options (options.time_limit_s) or an enclosing deadline."""
    module, attr = WORK[name]
    calls = itertools.count()
    original = getattr(module, attr)

    def counted(*a, **k):
        next(calls)
        return original(*a, **k)

    monkeypatch.setattr(module, attr, counted)
    p = problem()

    def run(limit: float | None) -> int:
        before = next(calls)
        try:
            HEURISTICS[name](p, SolverOptions(time_limit_s=limit))
        except XschedError:  # the first variant need not fit
            pass
        return next(calls) - before - 1

    free = run(None)
    late = run(0.0)
    with deadline(0.0):
        late_outside = run(None)
    assert late <= 1 < free and late_outside <= 1, (late, late_outside, free)


def test_the_runner_returns_its_best_plan_and_gap_when_the_clock_runs_out(monkeypatch) -> None:
    """Each heuristic's unit of work takes 0.3 s of a fake clock (reading it takes none): with a 1 s limit the
    heuristics stop after a few units, no timed member starts, and the run returns a plan with its gap."""
    clock, calls = FakeClock(0.0), {name: 0 for name in WORK}
    originals = {name: getattr(module, attr) for name, (module, attr) in WORK.items()}
    for name, (module, attr) in WORK.items():

        def costly(*a, _name=name, **k):
            calls[_name] += 1
            clock.t += 0.3
            return originals[_name](*a, **k)

        monkeypatch.setattr(module, attr, costly)
    p = problem()
    with using_clock(clock):
        r = solve_result(p.graph, p.profile, p.budgets, DEVICES, "auto", SolverOptions(time_limit_s=1.0), p.homes)
    assert r.plan is not None and r.record.gap is not None and r.record.bound is not None
    assert clock.t <= 1.0 * 1.1 + 1.0, calls  # the limit as the runner saw it, in the fake clock's seconds
    # each heuristic stopped after its first unit (sqrt's one checkpoint order counts under checkpoint); park,
    # last, was not started: a plan was there and the time gone
    assert calls["park"] <= 1 and max(calls.values()) <= 2, calls
    outcomes = {o.method: o for o in r.record.stats.members}
    assert outcomes["park"].status in ("time_limit", "no_incumbent")
    assert not {"hier", "milp", "park-search", "intervals-cpsat"} & set(outcomes)  # under MIN_MEMBER_S left
    # the same heuristics without the clock's pressure do many more units
    full = solve_result(p.graph, p.profile, p.budgets, DEVICES, "park", SolverOptions(time_limit_s=None), p.homes)
    assert calls["park"] > 3 and full.plan is not None


def test_hier_stops_between_levels_at_its_deadline() -> None:
    from xsched.solve.hier.solver import HierSettings, solve_hier

    p = problem(30)
    with deadline(0.0), pytest.raises(NoIncumbent, match="stopped at the time limit"):
        solve_hier(p, SolverOptions(time_limit_s=0.0), settings=HierSettings(max_leaf=4, workers=1))


def test_the_time_limit_bench_runs_in_its_reduced_mode(capsys) -> None:
    """scripts/bench_time_limit.py --quick: one small graph at 0.5 s, one table row (its exit code says whether the
    wall kept the target, which this test leaves to the bench: no wall time is asserted here). The row has a plan
    and its gap, or, when the machine's load left no heuristic time to start, says none was found in time."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    try:
        import bench_time_limit
    finally:
        sys.path.pop(0)
    assert bench_time_limit.main(["--quick"]) in (0, 1)
    rows = [r for r in capsys.readouterr().out.splitlines() if r.startswith("| random_layered_n100 ")]
    assert len(rows) == 1 and "| bench 80% | 0.5 |" in rows[0], rows
    found = "no plan" not in rows[0] and rows[0].endswith(" |") and not rows[0].endswith("| - |")
    assert found or "no plan within the budgets: not found within the time limit" in rows[0], rows


def test_without_a_plan_no_heuristic_starts_past_the_grace(monkeypatch) -> None:
    """Two heuristics that find nothing take 1.2 s each of a fake clock. Without a plan a heuristic still runs its
    first variant (which cannot be stopped once begun), but only when it starts within the limit x 1.1 + 1 s: the
    second starts at 1.2 s, park (at 2.4 s) does not, and nothing else runs after it, not even the search for a
    budget that works; the run says no plan was found in time."""
    from xsched.errors import BudgetError
    from xsched.solve import registry
    from xsched.solve.runner import Configuration, run

    clock = FakeClock(0.0)

    def no_fit(problem, options, warm):
        clock.t += 1.2
        raise BudgetError("does not fit", stage="solve")

    for name in ("slow-a", "slow-b"):
        monkeypatch.setitem(registry.SOLVERS, name, registry.heuristic(name, no_fit))
    parked = itertools.count()
    variant = park.park_variant
    monkeypatch.setattr(park, "park_variant", lambda *a, **k: (next(parked), variant(*a, **k))[1])
    p = problem()
    with using_clock(clock):
        r = run(p, Configuration("test", ("slow-a", "slow-b", "park")), SolverOptions(time_limit_s=1.0))
    assert r.plan is None and "not found within the time limit" in r.message, r.message
    assert "slow-b: no_incumbent" in r.message and "park: no_incumbent" in r.message and next(parked) == 0
    assert "smallest budget known to work: none looked for (no time left)" in r.message
    assert clock.t == pytest.approx(2.4)


def test_a_member_waits_for_its_first_import_only_while_its_time_lasts(tmp_path, monkeypatch) -> None:
    """An import that has not ended (held here by an event, not by a clock) leaves the member unstarted and nothing
    else starts meanwhile; once it ends, the member runs."""
    import sys
    import threading

    from xsched.solve import registry

    gate = threading.Event()
    monkeypatch.setattr(sys, "_xsched_test_gate", gate, raising=False)
    (tmp_path / "xsched_slow_import.py").write_text(
        "import sys\nsys._xsched_test_gate.wait(60)\n\ndef solver(problem, options, warm):\n    return 'ran'\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    member = registry.lazy("xsched_slow_import:solver")
    try:
        with deadline(0.05):
            r = member(problem(), SolverOptions(), None)
        assert r.plan is None and r.status == "no_incumbent" and "importing xsched_slow_import" in r.message
        assert not registry.import_within("xsched_test_never_imported", 0.05)  # an import is under way
        gate.set()
        assert member(problem(), SolverOptions(), None) == "ran"
    finally:
        gate.set()
        registry.import_within("xsched_slow_import", float("inf"))
        sys.modules.pop("xsched_slow_import", None)
        registry._IMPORTS.pop("xsched_slow_import", None)
    assert registry.import_within("json", 0.0)  # imported long ago: no thread, no wait


def test_the_linearised_interval_model_is_not_built_past_its_deadline(monkeypatch) -> None:
    """intervals-highs checks the clock while it builds its Pyomo model and does not hand a model to HiGHS that
    the time left cannot take: past its deadline it stops without a plan, and nothing is compiled."""
    from pyomo.repn.plugins.standard_form import LinearStandardFormCompiler

    from xsched.solve.intervals.solver import intervals_highs

    compiled = itertools.count()
    original = LinearStandardFormCompiler.write

    def counted(self, *a, **k):
        next(compiled)
        return original(self, *a, **k)

    monkeypatch.setattr(LinearStandardFormCompiler, "write", counted)
    p = problem()
    with using_clock(FakeClock(1.0)), pytest.raises(NoIncumbent, match="found no plan"):
        intervals_highs(p, SolverOptions(time_limit_s=0.5))
    assert next(compiled) == 0

    class Handed(Exception):
        """The model reached HiGHS's compiler (solving it to optimality takes minutes: stopped there)."""

    def handed(self, *a, **k):
        raise Handed

    monkeypatch.setattr(LinearStandardFormCompiler, "write", handed)
    with pytest.raises(Handed):  # without the clock's pressure the model is built and handed on
        intervals_highs(p, SolverOptions(time_limit_s=None))


def test_no_unit_of_work_starts_that_would_end_past_the_deadline() -> None:
    """Units of 0.4 s of a fake clock under a 1 s deadline: out_of_time stops after two, since a third, as long as
    the last, would end at 1.2 s; past_deadline still says the deadline itself has not passed."""
    clock, units = FakeClock(0.0), 0
    with using_clock(clock), deadline(1.0):
        while not out_of_time():
            clock.t += 0.4
            units += 1
        assert units == 2 and not past_deadline()


def test_a_member_whose_import_the_time_left_cannot_cover_is_skipped_and_recorded(monkeypatch) -> None:
    """A timed member that loads a module not yet imported is not started with less left than its import and
    MIN_MEMBER_S (the outcome says why); the heuristics' plan comes back with its gap."""
    from xsched.solve import registry, runner
    from xsched.solve.runner import Configuration, run

    ran = []
    member = registry.SolverEntry("needs-import", lambda *a: ran.append(1), kind="search", imports=("xsched_absent",))
    monkeypatch.setitem(registry.SOLVERS, "needs-import", member)
    monkeypatch.setitem(runner.IMPORT_S, "xsched_absent", 100.0)
    p = problem()
    with using_clock(FakeClock(0.0)):
        r = run(p, Configuration("test", ("checkpoint", "needs-import")), SolverOptions(time_limit_s=5.0))
    outcome = {o.method: o for o in r.record.stats.members}["needs-import"]
    assert not ran and outcome.status == "no_incumbent" and "loading xsched_absent" in outcome.message
    assert r.plan is not None and r.record.gap is not None


def test_the_h_ilp_is_not_built_past_its_deadline(monkeypatch) -> None:
    """hier's H-ILP checks the clock while its greedy start and its Pyomo model are built: past the deadline nothing
    reaches HiGHS and it stops without a plan; hier then falls back to a plan without the solver."""
    from xsched.solve.hier import hilp, solver
    from xsched.solve.hier.solver import HierSettings, solve_hier

    calls: list[tuple] = []
    original = hilp.solve_hilp

    def recorded(*args):
        calls.append(args)
        return original(*args)

    monkeypatch.setattr(solver, "solve_hilp", recorded)
    p, settings = problem(30), HierSettings(max_leaf=4, workers=1, refine=False)
    plan = solve_hier(p, SolverOptions(time_limit_s=None), settings=settings)
    assert plan.solver.stats.top == "hilp" and calls  # without the clock's pressure the top H-ILP solves
    handed = itertools.count()
    monkeypatch.setattr(hilp, "run_highs", lambda *a, **k: next(handed))
    top = calls[-1]
    with using_clock(FakeClock(1.0)), pytest.raises(NoIncumbent, match="was not solved: the time limit came"):
        original(*top[:-1], SolverOptions(time_limit_s=0.5))
    assert next(handed) == 0
    monkeypatch.setattr(solver, "solve_hilp", original)
    with using_clock(FakeClock(0.01)), deadline(1.0):  # the H-ILPs meet the deadline: a plan without HiGHS
        stats = solve_hier(p, SolverOptions(time_limit_s=1.0), settings=settings).solver.stats
    assert next(handed) == 1  # no H-ILP reached HiGHS: the greedy schedule's plan, or one without the model
    assert "was not solved" in stats.top if stats.top != "hilp" else stats.top_stats.model_status == "time_limit"
