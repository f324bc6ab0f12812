"""The order search: starting orders and moves stay topological, the search never does worse than its starting
orders, the portfolio reports the order of the plan it returns, and the seeded random layered generator."""

from __future__ import annotations

import itertools
import json
import random
import sys
from pathlib import Path

import pytest
from test_intervals import checked, random_dag
from test_milp import GRAPHS, exhaustive_optimum, profile_for, tightest_budget, times_of

from xsched.errors import XschedError
from xsched.importers import import_networkx
from xsched.simulate import simulate
from xsched.solve.api import solve
from xsched.solve.intervals import solve_intervals
from xsched.solve.options import SolverOptions
from xsched.solve.order.order import (
    depth_first_order,
    eager_peak_of,
    greedy_order,
    neighbours,
    search_order,
    starting_orders,
    topological,
)
from xsched.solve.problem import Problem
from xsched.solve.reference import eager_peak, eager_plan
from xsched.solve.registry import SOLVERS

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from random_layered import random_layered  # noqa: E402

EXACT = SolverOptions(time_limit_s=20.0, mip_gap=0.0)


@pytest.mark.parametrize("seed", range(6))
def test_starting_orders_and_moves_are_topological(seed: int) -> None:
    g = random_dag(seed, n=8)
    for order in (greedy_order(g), depth_first_order(g), *starting_orders(g).values()):
        assert topological(g, order)
    rng = random.Random(seed)
    for cand in neighbours(g, greedy_order(g), rng, 10):
        assert topological(g, cand) and cand != greedy_order(g)


def test_a_search_that_gives_up_after_one_order_tries_the_warm_starts_own_order() -> None:
    """The warm plan's order (here none of the named ones, and not the least eager peak) comes first, so a scorer
    that gives a plan only where the warm start is a complete hint still finds one before giving up."""
    g = random_dag(3, n=10)
    named = set(starting_orders(g).values())
    rng = random.Random(0)
    own = next(o for o in neighbours(g, greedy_order(g), rng, 50) if o not in named)
    warm = order_plan_of(g, own)
    starts = starting_orders(g, warm)
    assert next(iter(starts.items())) == ("warm", own) and set(starts.values()) == named | {own}

    def score(order, seconds):  # noqa: ANN001, ANN202
        if order != own:
            raise XschedError("no plan in this order", stage="solve")
        return warm

    plan, order, log = search_order(g, score, 0.5, warm, give_up=1)
    assert plan is warm and order == own and log.origin == "warm"


def order_plan_of(g, order):  # noqa: ANN001, ANN201
    from xsched.solve.order.order import unbudgeted_plan

    return unbudgeted_plan(g, order, "cpu", {v: "cpu" for v in g.inputs})


def test_eager_peak_of_the_graph_order_is_the_simulators() -> None:
    for g in GRAPHS.values():
        assert eager_peak_of(g, tuple(range(len(g.ops)))) == eager_peak(g)


def test_greedy_order_lowers_the_eager_peak_of_a_fan_out() -> None:
    # x feeds three big producers, each reduced by a small op: eager makes all three big values first
    from xsched.contracts.graph import Graph, Op, Value

    vals = [Value("x", 1, "input")] + [Value(f"b{i}", 100) for i in range(3)] + [Value(f"s{i}", 1) for i in range(3)]
    ops = [Op(f"big{i}", "t", ("x",), (f"b{i}",)) for i in range(3)]
    ops += [Op(f"red{i}", "t", (f"b{i}",), (f"s{i}",)) for i in range(3)]
    g = Graph("fan", tuple(vals), tuple(ops), ("s0", "s1", "s2"))
    assert eager_peak_of(g, greedy_order(g)) < eager_peak_of(g, tuple(range(6))) == eager_peak(g)


@pytest.mark.parametrize("seed", range(3))
def test_order_search_reaches_the_free_order_optimum_of_small_dags(seed: int) -> None:
    pytest.importorskip("ortools")
    g = random_dag(seed + 10, n=6)
    prof = profile_for(g, {"cpu": {o.id: 1.0 + (5 * i) % 3 for i, o in enumerate(g.ops)}})
    homes = {"x": "cpu"}
    budgets = {"cpu": tightest_budget(g, prof, homes)}
    want = exhaustive_optimum(g, prof, budgets, ["cpu"], homes)

    def score(order, seconds):  # noqa: ANN001, ANN202
        return solve_intervals(
            Problem(g, prof, budgets, ["cpu"], homes), SolverOptions(time_limit_s=seconds), order=order, workers=1
        )

    plan, order, log = search_order(g, score, 600.0, per_try_s=2.0)  # ends when the neighbourhood is exhausted
    checked(g, plan, prof, budgets)
    assert topological(g, order) and log.orders_tried >= 1
    assert plan.predicted.time_s == pytest.approx(want)
    # no order is scored twice, so the search ends once the neighbourhood is exhausted, not at its time limit
    n_orders = sum(topological(g, p) for p in itertools.permutations(range(len(g.ops))))
    assert log.orders_tried <= n_orders


def test_portfolio_returns_a_valid_plan_and_its_members() -> None:
    g = GRAPHS["diamond_train"]
    prof = profile_for(g, {"cpu": times_of(g)})
    homes = {v: "cpu" for v in g.inputs}
    budgets = {"cpu": tightest_budget(g, prof, homes)}
    opts = SolverOptions(time_limit_s=60.0, mip_gap=0.0, solver_threads=1)
    plan = solve(g, prof, budgets, method="portfolio", options=opts)
    checked(g, plan, prof, budgets)
    assert plan.solver.method == "portfolio" and plan.solver.found_by in SOLVERS
    assert plan.predicted.time_s == pytest.approx(exhaustive_optimum(g, prof, budgets, ["cpu"], homes))
    ran = [m.method for m in plan.solver.stats.members]
    assert "checkpoint" in ran and "hier" not in ran  # the heuristics first; no hierarchical solver
    assert plan.solver.gap is not None and plan.solver.gap >= 0


def test_random_layered_generator_is_seeded_and_importable(tmp_path: Path) -> None:
    a, b, c = random_layered(60, seed=1), random_layered(60, seed=1), random_layered(60, seed=2)
    assert a == b and a != c
    path = tmp_path / "rl.json"
    path.write_text(json.dumps(a))
    g, prof = import_networkx(path)
    assert len(g.ops) == 60 and topological(g, tuple(range(60)))  # names follow the layers
    plan = eager_plan(g, "bench", prof)
    assert simulate(g, plan, prof).computes == 60
    with pytest.raises(ValueError, match="at least 3"):
        random_layered(2)
