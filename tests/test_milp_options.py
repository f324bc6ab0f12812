"""The multi-device MILP beyond optimality: budget errors, chosen homes, energy caps and weights, warm starts and
time limits, a benchmark graph, and random ops drawn from one generator."""

from __future__ import annotations

import pytest
from conftest import BENCH
from test_milp import DETERMINISTIC, FAST, GRAPHS, checked, profile_for, times_of

from xsched.contracts.graph import Graph, Op, Value
from xsched.contracts.plan import Compute, Copy
from xsched.contracts.profile import DeviceInfo, LinkCost, OpCost, Profile
from xsched.errors import BudgetError
from xsched.importers import import_networkx
from xsched.simulate import simulate
from xsched.solve.milp.milp import solve_milp
from xsched.solve.options import SolverOptions
from xsched.solve.problem import Problem
from xsched.solve.reference import eager_peak


def test_budget_below_any_plan_names_the_device() -> None:
    g = GRAPHS["diamond"]  # computing b and c needs a, b and c at once: more than any single op needs
    prof = profile_for(g, {"cpu": times_of(g)})
    homes = {"x": "cpu"}
    with pytest.raises(BudgetError, match="cpu") as e:
        solve_milp(Problem(g, prof, {"cpu": 4 + 30 + 10 + 20 - 1}, ["cpu"], homes), FAST)
    assert "MILP proves" in str(e.value) and e.value.device == "cpu"
    with pytest.raises(BudgetError) as e:
        solve_milp(Problem(g, prof, {"cpu": 20}, ["cpu"], homes), FAST)  # below one op's own needs: the pre-check
    assert e.value.device == "cpu"
    checked(g, solve_milp(Problem(g, prof, {"cpu": 64}, ["cpu"], homes), FAST), prof, {"cpu": 64})


def test_solver_picks_param_homes_when_allowed() -> None:
    vals = (
        Value("x", 4, "input"),
        Value("w", 50, "param"),
        Value("y", 8),
        Value("loss", 1),
        Value("gw", 50, grad_of="w"),
    )
    ops = (
        Op("mm", "t", ("x", "w"), ("y",)),
        Op("l", "t", ("y",), ("loss",), "loss"),
        Op("g", "t", ("y", "x"), ("gw",), "bwd"),
    )
    g = Graph("param", vals, ops, ("loss", "gw"))
    slow = LinkCost(100.0, 1.0)
    prof = profile_for(
        g, {"cpu": {"l": 1.0}, "gpu": {"mm": 1.0, "l": 1.0, "g": 1.0}}, {"cpu->gpu": slow, "gpu->cpu": slow}
    )
    budgets = {"cpu": 1000, "gpu": 1000}
    homes = {"x": "gpu", "w": "cpu"}
    fixed = checked(g, solve_milp(Problem(g, prof, budgets, ["cpu", "gpu"], homes), FAST), prof, budgets)
    moved = solve_milp(
        Problem(g, prof, budgets, ["cpu", "gpu"], homes), SolverOptions(time_limit_s=20, fix_homes=False)
    )
    checked(g, moved, prof, budgets)
    assert moved.homes["w"] == "gpu" and moved.homes["x"] == "gpu"
    assert moved.predicted.time_s == pytest.approx(3.0)  # no copy of w and back of gw
    assert fixed.predicted.time_s > 200.0


def test_energy_cap_and_weight() -> None:
    g = GRAPHS["chain4"]
    t = times_of(g)
    link = LinkCost(0.0, 1e30)
    # the gpu is twice as fast but spends 2 J/s against the cpu's 1 J/s (see profile_for): equal energy per op
    prof = profile_for(g, {"cpu": t, "gpu": {o: s / 2 for o, s in t.items()}}, {"cpu->gpu": link, "gpu->cpu": link})
    prof = Profile(
        prof.graph,
        prof.devices,
        {
            d: {o: OpCost(c.time_s, c.energy_j * (1.5 if d == "gpu" else 1.0)) for o, c in ops.items()}
            for d, ops in prof.compute.items()
        },
        prof.copy,
    )
    budgets = {"cpu": 1000, "gpu": 1000}
    fastest = checked(g, solve_milp(Problem(g, prof, budgets, ["cpu", "gpu"], {"x": "cpu"}), FAST), prof, budgets)
    assert fastest.predicted.energy_j == pytest.approx(1.5 * sum(t.values()))
    cap = 1.25 * sum(t.values())
    capped = solve_milp(
        Problem(g, prof, budgets, ["cpu", "gpu"], {"x": "cpu"}), SolverOptions(time_limit_s=20, energy_cap_j=cap)
    )
    checked(g, capped, prof, budgets)
    assert capped.predicted.energy_j <= cap + 1e-9 and capped.predicted.time_s > fastest.predicted.time_s
    green = solve_milp(
        Problem(g, prof, budgets, ["cpu", "gpu"], {"x": "cpu"}), SolverOptions(time_limit_s=20, alpha_energy=10.0)
    )
    assert checked(g, green, prof, budgets).predicted.energy_j == pytest.approx(sum(t.values()))


def test_warm_start_is_an_incumbent_and_other_pyomo_solvers_run() -> None:
    g = GRAPHS["diamond_train"]
    prof = profile_for(g, {"cpu": times_of(g)})
    budgets = {"cpu": 94}  # the tightest budget: one recompute
    first = checked(g, solve_milp(Problem(g, prof, budgets, ["cpu"], {"x": "cpu"}), FAST), prof, budgets)
    again = solve_milp(Problem(g, prof, budgets, ["cpu"], {"x": "cpu"}), FAST, warm_start=first)
    assert checked(g, again, prof, budgets).predicted.time_s == pytest.approx(first.predicted.time_s)
    assert again.solver.stats.warm_start == "milp"
    legacy = solve_milp(
        Problem(g, prof, budgets, ["cpu"], {"x": "cpu"}),
        SolverOptions(solver="appsi_highs", time_limit_s=20, mip_gap=0.0),
    )
    assert checked(g, legacy, prof, budgets).predicted.time_s == pytest.approx(first.predicted.time_s)


def test_a_time_limited_solve_from_a_warm_start_returns_a_plan_no_worse() -> None:
    """Stopped by its limit, the MILP still returns its best incumbent: warm-started from the checkpoint
    heuristic's plan (in graph order, so it maps onto the stages), that is a plan at least as fast."""
    from xsched.solve.heuristics.checkpoint import checkpoint_search

    g, prof = import_networkx(BENCH / "random_layered_n100.json")
    budgets = {"bench": int(eager_peak(g) * 0.8)}
    start = checkpoint_search(Problem(g, prof, budgets, ["bench"], {}))
    plan = solve_milp(Problem(g, prof, budgets, ["bench"], {}), SolverOptions(time_limit_s=10.0), warm_start=start)
    checked(g, plan, prof, budgets)
    assert plan.solver.stats.warm_start_mapped and plan.predicted.time_s <= start.predicted.time_s * (1 + 1e-9)


def test_fcn8_vgg_at_80_percent() -> None:
    g, prof = import_networkx(BENCH / "checkmate_fcn_8_vgg_train.json")
    budgets = {"bench": int(eager_peak(g) * 0.8)}
    plan = checked(g, solve_milp(Problem(g, prof, budgets, ["bench"], {}), DETERMINISTIC), prof, budgets)
    base = sum(prof.op_cost(o.id, "bench").time_s for o in g.ops)
    assert plan.predicted.time_s / base - 1 < 0.01


def _shared_draw(target: str) -> tuple[Graph, Profile]:
    """One 1 MB value `m` made by `target` from nothing and read on both a CPU and a GPU (each reader runs on one
    of them only); computing `m` takes 1 ms anywhere, copying it over the 1 MB/s link takes 1 s."""
    g = Graph(
        "draw",
        (Value("m", 10**6), Value("p", 4), Value("q", 4)),
        (
            Op("r", target, (), ("m",)),
            Op("b", "aten.sum.default", ("m",), ("p",)),
            Op("c", "aten.sum.default", ("m",), ("q",)),
        ),
        ("p", "q"),
    )
    compute = {"cpu": {"r": OpCost(1e-3), "b": OpCost(1e-3)}, "cuda:0": {"r": OpCost(1e-3), "c": OpCost(1e-3)}}
    links = {"cpu->cuda:0": LinkCost(1e-3, 1e6), "cuda:0->cpu": LinkCost(1e-3, 1e6)}
    return g, Profile(g.fingerprint, {"cpu": DeviceInfo("cpu"), "cuda:0": DeviceInfo("cuda")}, compute, links)


@pytest.mark.parametrize(("target", "random"), [("aten.rand.default", True), ("aten.zeros.default", False)])
def test_a_random_op_draws_from_one_rng_only(target: str, random: bool) -> None:
    """Running `m`'s maker on both devices saves the 1 s copy, but a random maker drawing from the CPU's and then
    the GPU's generator gives two different `m`: the MILP must copy instead (the deterministic control may not)."""
    g, profile = _shared_draw(target)
    plan = solve_milp(Problem(g, profile, {}, ("cpu", "cuda:0"), {}))
    simulate(g, plan, profile)
    ran_on = {s.device for s in plan.steps if isinstance(s, Compute) and s.op == "r"}
    copies = [s for s in plan.steps if isinstance(s, Copy)]
    if random:
        assert len(ran_on) == 1 and [c.value for c in copies] == ["m"]
    else:
        assert ran_on == {"cpu", "cuda:0"} and not copies
