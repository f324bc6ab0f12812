"""The interval models' timed objective: copies run on their link beside the stage's computes, so a value parked on a
store where the sequential optimum recomputes; both backends agree; one device prices exactly the computes. Held
outputs (graph.held_outputs) stay resident from the autograd boundary to the end."""

from __future__ import annotations

from dataclasses import replace

import pytest
from oracle import assert_prediction_matches
from oracle import makespan as oracle_makespan
from test_intervals import BACKENDS
from test_milp import exhaustive_optimum
from test_offload import fwd_bwd
from test_park import DEVICES, with_store

from xsched.contracts.plan import Compute, Copy, Free
from xsched.contracts.profile import OpCost, Profile
from xsched.errors import PlanError
from xsched.solve.heuristics.park import park_remat
from xsched.solve.intervals import solve_intervals
from xsched.solve.options import SolverOptions
from xsched.solve.problem import Problem, validated
from xsched.solve.reference import eager_peak

EXACT = SolverOptions(time_limit_s=20.0, mip_gap=0.0)


def parking_case() -> tuple:
    """fwd_bwd(3) at 100 B under its eager peak: one activation must go. A copy takes 0.81 s, an op 1 s: parking
    (two copies, 1.62 s in sequence) loses to one recompute (1 s) in sequential time, wins when the copy out hides
    behind the next forward op (only the copy back, read at once by b0, is left in the open)."""
    g = fwd_bwd(3)
    profile = with_store(g, latency=0.01, bandwidth=125.0)
    return g, profile, {"cpu:0": eager_peak(g) - 100}, {"x": "cpu:0"}


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_copy_beside_compute_beats_the_sequential_optimums_recompute(backend: str) -> None:
    g, profile, budgets, homes = parking_case()
    sequential = exhaustive_optimum(g, profile, budgets, list(DEVICES), homes)  # every step sequence searched
    assert sequential == pytest.approx(7.0)  # six ops and one recompute: the old objective's optimum
    plan = solve_intervals(
        Problem(g, profile, budgets, list(DEVICES), homes), EXACT, backend=backend, workers=1, c_max=2
    )
    assert_prediction_matches(g, plan, profile, budgets)
    assert plan.solver.stats.model_bound == pytest.approx(plan.solver.stats.model_objective, rel=1e-6)  # proven
    assert plan.solver.status == "feasible"  # the model's time is an estimate with a store: no optimum claimed
    assert sum(isinstance(s, Compute) for s in plan.steps) == len(g.ops)  # nothing recomputed
    assert sum(isinstance(s, Copy) for s in plan.steps) == 2  # parked and brought back
    assert plan.predicted.time_s > sequential  # worse in sequence ...
    assert oracle_makespan(g, plan, profile) == pytest.approx(6.0 + 0.81)  # ... better overlapped: 6 ops + copy back


def test_both_backends_agree_on_the_timed_optimum() -> None:
    g, profile, budgets, homes = parking_case()
    problem = Problem(g, profile, budgets, list(DEVICES), homes)
    got = [
        solve_intervals(problem, EXACT, backend=b, workers=1, c_max=2).solver.stats.model_objective
        for b in ("cpsat", "highs")
    ]
    assert got[0] == pytest.approx(got[1], rel=1e-6)
    assert got[0] == pytest.approx(6.81, rel=1e-5)  # the hand count: the copy out hidden, the copy back not


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_device_prices_exactly_its_computes(backend: str) -> None:
    g = fwd_bwd(4)
    profile = Profile(
        g.fingerprint, {"cpu:0": with_store(g).devices["cpu:0"]}, {"cpu:0": with_store(g).compute["cpu:0"]}, {}
    )
    budgets = {"cpu:0": eager_peak(g) - 100}
    plan = solve_intervals(
        Problem(g, profile, budgets, ["cpu:0"], {"x": "cpu:0"}), EXACT, backend=backend, workers=1, c_max=2
    )
    computes = sum(isinstance(s, Compute) for s in plan.steps)
    assert computes > len(g.ops)  # a recompute was needed, so the objective is more than the ops once
    assert plan.solver.stats.model_objective == pytest.approx(plan.predicted.time_s, rel=1e-5)
    assert plan.predicted.time_s == pytest.approx(computes * 1.0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_held_output_stays_where_it_was_through_backward(backend: str) -> None:
    """fwd_bwd(3) with its last activation a2 also an output, held by the caller. At 500 B, unheld, the model parks
    a2 on the store after b2 (a plan the hold rule refuses); held, it keeps a2 on cpu:0 and parks a0 instead."""
    g = replace(fwd_bwd(3), outputs=("g0", "a2"), held_outputs=("a2",))
    profile, budgets, homes = with_store(g, latency=0.01, bandwidth=125.0), {"cpu:0": 500}, {"x": "cpu:0"}
    unheld = replace(g, held_outputs=())
    loose = solve_intervals(Problem(unheld, profile, budgets, list(DEVICES), homes), EXACT, backend=backend, c_max=2)
    with pytest.raises(PlanError, match="holds through backward"):
        validated(g, loose, profile, budgets)
    plan = solve_intervals(Problem(g, profile, budgets, list(DEVICES), homes), EXACT, backend=backend, c_max=2)
    assert validated(g, plan, profile, budgets).steps == plan.steps  # the hold rule drops nothing
    assert_prediction_matches(g, plan, profile, budgets)
    after = plan.steps[plan.boundary :]
    assert not any(isinstance(s, (Free, Copy)) and s.value == "a2" for s in after)
    assert not any(isinstance(s, Compute) and s.op == "f2" for s in after)


def slow_link_case(bandwidth: float) -> tuple:
    """fwd_bwd(4) at 100 B under its eager peak: forward ops 1 s, backward ops 3 s, a copy of 100 B taking 0.01 +
    100 / bandwidth s. At 40 B/s (2.51 s) parking a0 beats recomputing it (17 s in all): its copy out outlasts the
    next forward op and hides behind three (the old model counted it beyond its stage: 17.51 s), its copy back
    hides behind b2; the makespan is the computes' 16 s."""
    g = fwd_bwd(4)
    store = with_store(g, latency=0.01, bandwidth=bandwidth)
    compute = {"cpu:0": {o.id: OpCost(1.0 if o.id.startswith("f") else 3.0) for o in g.ops}, "cpu:1": {}}
    profile = Profile(g.fingerprint, store.devices, compute, store.copy)
    return g, profile, {"cpu:0": eager_peak(g) - 100}, {"x": "cpu:0"}


# at 30 B/s each copy (3.343 s) outlasts its three ops by 0.343 s: the free of a0 waits for the copy out, b3 for
# that free, and b0 for the copy back (the hand count)
@pytest.mark.parametrize(("bandwidth", "want"), [(40.0, 16.0), (30.0, 16.0 + 2 * (0.01 + 100 / 30 - 3))])
def test_the_models_time_is_the_simulated_makespan_with_copies_longer_than_a_stage(bandwidth, want) -> None:
    g, profile, budgets, homes = slow_link_case(bandwidth)
    problem = Problem(g, profile, budgets, list(DEVICES), homes)
    warm = solve_intervals(problem, EXACT, workers=1, c_max=2)  # the stage objective's plan: it recomputes
    assert warm.predicted.makespan_s == pytest.approx(17.0)
    plan = solve_intervals(problem, EXACT, warm, workers=1, c_max=2)  # link time, from that plan
    assert_prediction_matches(g, plan, profile, budgets)
    assert [s.value for s in plan.steps if isinstance(s, Copy)] == ["a0", "a0"]  # parked, nothing recomputed
    assert sum(isinstance(s, Compute) for s in plan.steps) == len(g.ops)
    assert oracle_makespan(g, plan, profile) == pytest.approx(want)
    assert plan.solver.stats.model_objective == pytest.approx(want, rel=1e-6)


def test_the_models_time_of_a_heuristics_plan_is_its_simulated_makespan() -> None:
    """park's plan as the warm start: the model's time of the plan it keeps is the simulator's makespan of the
    extracted plan (an independent event sweep)."""
    g, profile, budgets, homes = slow_link_case(60.0)  # copies of 1.68 s, a forward op takes 1 s
    problem = Problem(g, profile, budgets, list(DEVICES), homes)
    warm = park_remat(problem)
    assert sum(isinstance(s, Copy) for s in warm.steps) == 2  # a0 parked and brought back
    plan = solve_intervals(problem, EXACT, warm, workers=1, c_max=2)
    assert plan.solver.stats.model_objective == pytest.approx(oracle_makespan(g, plan, profile), rel=1e-6)
    assert oracle_makespan(g, plan, profile) == pytest.approx(oracle_makespan(g, warm, profile))
