"""The stage MILP's hand-off to HiGHS: the standard-form matrix is the Pyomo model, solves with other thread counts
in one process, a heuristic plan as a feasible start, the LP-guided restricted searches, and a time limit shorter
than the model's build."""

from __future__ import annotations

from dataclasses import replace

import pytest
from conftest import BENCH
from test_milp import (
    DETERMINISTIC,
    FAST,
    GRAPHS,
    checked,
    claims_optimal_soundly,
    exhaustive_optimum,
    profile_for,
    tightest_budget,
    times_of,
)

from xsched.errors import NoIncumbent
from xsched.importers import import_networkx
from xsched.solve.milp.milp import solve_milp
from xsched.solve.options import SolverOptions
from xsched.solve.problem import Problem
from xsched.solve.reference import eager_peak


def test_highs_matrix_is_the_pyomo_model() -> None:
    """The standard-form hand-off keeps every row, bound, integrality and the objective: a MIP start evaluated
    through the HiGHS matrix agrees with Pyomo's own evaluation of the model."""
    import numpy as np
    import pyomo.environ as pyo

    from xsched.solve.milp.backends import to_highs
    from xsched.solve.milp.extract import plan_to_solution
    from xsched.solve.milp.milp import build_model, set_start
    from xsched.solve.milp.stages import index_stages

    g = GRAPHS["diamond_train"]
    prof = profile_for(g, {"cpu": times_of(g)})
    budgets = {"cpu": 94}  # the tightest budget: one recompute
    plan = solve_milp(Problem(g, prof, budgets, ["cpu"], {"x": "cpu"}), FAST)
    st = index_stages(g, prof, budgets, ["cpu"], {"x": "cpu"}, FAST)
    m = build_model(st, FAST)
    set_start(m, st, plan_to_solution(st, plan))
    h, columns, watched = to_highs(m)
    lp = h.getLp()
    x = np.array([v.value for v in columns], dtype=float)
    assert lp.num_col_ == len(columns) and lp.num_row_ >= sum(len(c) for c in m.component_objects(pyo.Constraint))
    assert [int(k.value) for k in lp.integrality_] == [int(v.is_integer()) for v in columns]
    assert all(watched >= 0) and len(watched) == len(m.R) + len(m.S) + len(m.C) + len(m.H)
    assert float(np.dot(lp.col_cost_, x) + lp.offset_) == pytest.approx(pyo.value(m.obj))
    a = lp.a_matrix_
    rows = np.zeros(lp.num_row_)
    for j in range(lp.num_col_):
        for k in range(a.start_[j], a.start_[j + 1]):
            rows[a.index_[k]] += a.value_[k] * x[j]
    assert np.all(rows <= np.array(lp.row_upper_) + 1e-7) and np.all(rows >= np.array(lp.row_lower_) - 1e-7)
    for c in m.component_data_objects(pyo.Constraint, active=True):  # the same start satisfies Pyomo's rows
        assert (c.upper is None or pyo.value(c.body) <= pyo.value(c.upper) + 1e-7) and (
            c.lower is None or pyo.value(c.body) >= pyo.value(c.lower) - 1e-7
        )


@pytest.mark.parametrize("first, then", [(None, 1), (1, None), (1, 2)])
def test_solves_with_other_thread_counts_in_one_process_all_run(first: int | None, then: int | None) -> None:
    """HiGHS refuses a run whose thread count differs from the one its process-wide scheduler started with: the
    second solve (as the hierarchical solver's one-thread H-ILP after a default MILP) still finds the optimum."""
    g = GRAPHS["chain3_train"]
    prof = profile_for(g, {"cpu": times_of(g)})
    homes = {v: "cpu" for v in g.inputs}
    budgets = {"cpu": eager_peak(g)}
    for threads in (first, then):
        plan = solve_milp(Problem(g, prof, budgets, ["cpu"], homes), replace(FAST, solver_threads=threads))
        assert claims_optimal_soundly(g, prof, homes, plan)


def test_heuristic_plan_is_a_feasible_start_of_the_lean_model() -> None:
    """The aggregated free group and the pruned free positions still admit a real plan: the checkpoint
    heuristic's plan on random_layered_n100 at 80%, mapped to stage variables, satisfies every constraint."""
    import pyomo.environ as pyo

    from xsched.solve.heuristics.checkpoint import checkpoint_search
    from xsched.solve.milp.extract import plan_to_solution
    from xsched.solve.milp.milp import build_model, set_start
    from xsched.solve.milp.stages import index_stages

    g, prof = import_networkx(BENCH / "random_layered_n100.json")
    budgets = {"bench": int(eager_peak(g) * 0.8)}
    start = checkpoint_search(Problem(g, prof, budgets, ["bench"], {}))
    st = index_stages(g, prof, budgets, ["bench"], {}, FAST)
    m = build_model(st, FAST)
    sol = plan_to_solution(st, start)
    assert sol is not None and any(i < t for _, t, i in sol.r_on)  # it recomputes
    set_start(m, st, sol)
    bad = [
        c.name
        for c in m.component_data_objects(pyo.Constraint, active=True)
        if (c.upper is not None and pyo.value(c.body) > pyo.value(c.upper) + 1e-6)
        or (c.lower is not None and pyo.value(c.body) < pyo.value(c.lower) - 1e-6)
    ]
    assert not bad
    assert pyo.value(m.obj) * st.tu == pytest.approx(start.predicted.time_s)


@pytest.mark.parametrize("name", sorted(GRAPHS))
def test_restricted_searches_do_not_change_the_optimum(name: str) -> None:
    """With and without the LP-guided restricted searches the tightest budget reaches the exhaustive optimum."""
    g = GRAPHS[name]
    prof = profile_for(g, {"cpu": times_of(g)})
    homes = {v: "cpu" for v in g.inputs}
    budgets = {"cpu": tightest_budget(g, prof, homes)}
    want = exhaustive_optimum(g, prof, budgets, ["cpu"], homes)
    for restricted in ((), ((0, 0.5),), SolverOptions().restricted):
        opts = replace(FAST, restricted=restricted)
        plan = checked(g, solve_milp(Problem(g, prof, budgets, ["cpu"], homes), opts), prof, budgets)
        assert claims_optimal_soundly(g, prof, homes, plan) and plan.predicted.time_s == pytest.approx(want)


def test_a_limit_shorter_than_the_models_build_is_refused_up_front() -> None:
    """Pyomo's build cannot be interrupted: a limit it would outlast gives NoIncumbent before building (auto once
    handed its last member 0.1 s on a 258-op graph and got the plan 13 s late)."""
    g, prof = import_networkx(BENCH / "random_layered_n100.json")
    budgets = {"bench": int(eager_peak(g) * 0.8)}
    with pytest.raises(NoIncumbent, match="to build, more than the"):
        solve_milp(Problem(g, prof, budgets, ["bench"], {}), SolverOptions(time_limit_s=0.01))


def test_without_the_lp_the_restricted_searches_use_the_structural_restriction() -> None:
    """With no LP relaxation (lp_share 0, what a big graph's slow LP falls back to) the restricted searches keep the
    recomputes of the first computes' inputs instead, and still find a good plan without a warm start."""
    g, prof = import_networkx(BENCH / "checkmate_fcn_8_vgg_train.json")
    budgets = {"bench": int(eager_peak(g) * 0.8)}
    plan = checked(
        g, solve_milp(Problem(g, prof, budgets, ["bench"], {}), replace(DETERMINISTIC, lp_share=0.0)), prof, budgets
    )
    base = sum(prof.op_cost(o.id, "bench").time_s for o in g.ops)
    assert plan.predicted.time_s / base - 1 < 0.01
