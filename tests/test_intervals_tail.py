"""The interval models' stage T: a recompute after the last first compute (an output rebuilt at the end) is found
by both backends at the exhaustive optimum, and a plan with such a step (and a copy after it) is a complete hint."""

from __future__ import annotations

import pytest
from oracle import assert_prediction_matches
from oracle import makespan as oracle_makespan
from test_intervals import BACKENDS
from test_milp import exhaustive_optimum
from test_offload import fwd_bwd
from test_park import DEVICES, with_store

from xsched.contracts.graph import Graph, Op, Value
from xsched.contracts.plan import Compute, Copy, Free, Plan, autograd_boundary
from xsched.contracts.profile import DeviceInfo, OpCost, Profile
from xsched.contracts.result import SolveResult
from xsched.simulate import predicted_plan
from xsched.solve.intervals import solve_intervals
from xsched.solve.intervals.data import build_data
from xsched.solve.intervals.extract import hint_from_plan, step_counts, to_plan
from xsched.solve.options import SolverOptions
from xsched.solve.problem import Problem

EXACT = SolverOptions(time_limit_s=20.0, mip_gap=0.0)
HOMES = {"x": "cpu:0"}
BUDGET = 4 + 80  # x, and two of the three 40 B values: a cannot stay through f2, and it is an output


def tail_graph() -> Graph:
    """x -> f0 -> a -> f1 -> b -> f2 -> c; a and c are outputs. Under BUDGET, f2 holds b and c, so a is freed
    before it and, as an output, made again after it: a recompute after the last first compute."""
    values = (Value("x", 4, "input"), Value("a", 40), Value("b", 40), Value("c", 40))
    ops = (Op("f0", "t", ("x",), ("a",)), Op("f1", "t", ("a",), ("b",)), Op("f2", "t", ("b",), ("c",)))
    return Graph("tail", values, ops, ("a", "c"))


def one_device(g: Graph) -> Profile:
    return Profile(g.fingerprint, {"cpu:0": DeviceInfo("cpu")}, {"cpu:0": {o.id: OpCost(1.0) for o in g.ops}}, {})


def plan_of(g: Graph, profile: Profile, budgets: dict, steps: list) -> Plan:
    plan = Plan(
        g.fingerprint, budgets, HOMES, tuple(steps), SolveResult("hand", "heuristic"), autograd_boundary(g, steps)
    )
    return predicted_plan(g, plan, profile, "the hand plan")


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_output_rebuilt_after_the_last_op_is_the_exhaustive_optimum(backend: str) -> None:
    g = tail_graph()
    profile, budgets = one_device(g), {"cpu:0": BUDGET}
    want = exhaustive_optimum(g, profile, budgets, ["cpu:0"], HOMES)
    assert want == pytest.approx(4.0)  # the hand count: three ops and f0 again at the end
    plan = solve_intervals(Problem(g, profile, budgets, ["cpu:0"], HOMES), EXACT, backend=backend, workers=1)
    assert_prediction_matches(g, plan, profile, budgets)
    assert plan.solver.status == "optimal"
    assert plan.predicted.time_s == pytest.approx(want)
    computes = [s.op for s in plan.steps if isinstance(s, Compute)]
    assert computes == ["f0", "f1", "f2", "f0"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_with_a_slow_store_the_recompute_still_beats_parking(backend: str) -> None:
    """A copy takes 5 s, an op 1 s: parking a (out, and back or left there) loses to rebuilding it at the end, in
    sequence (the exhaustive search) and overlapped (the timed objective's hand count: 4 s)."""
    g = tail_graph()
    profile, budgets = with_store(g, latency=5.0), {"cpu:0": BUDGET}
    assert exhaustive_optimum(g, profile, budgets, list(DEVICES), HOMES) == pytest.approx(4.0)
    plan = solve_intervals(Problem(g, profile, budgets, list(DEVICES), HOMES), EXACT, backend=backend, workers=1)
    assert_prediction_matches(g, plan, profile, budgets)
    assert plan.solver.stats.model_objective == pytest.approx(4.0, rel=1e-5)
    assert not any(isinstance(s, Copy) for s in plan.steps)
    assert oracle_makespan(g, plan, profile) == pytest.approx(4.0)


def test_a_plan_rebuilding_and_copying_at_the_end_is_a_complete_hint() -> None:
    """f0 again after f2, then a copied to the store and freed: the recompute lands in stage T, the copy after it
    among the final copies; the hint covers every step and replays as the same steps."""
    g = tail_graph()
    profile, budgets = with_store(g), {"cpu:0": BUDGET}
    steps = [
        Compute("f0", "cpu:0"),
        Compute("f1", "cpu:0"),
        Free("a", "cpu:0"),
        Compute("f2", "cpu:0"),
        Free("b", "cpu:0"),
        Compute("f0", "cpu:0"),
        Copy("a", "cpu:0", "cpu:1"),
        Free("a", "cpu:0"),
    ]
    plan = plan_of(g, profile, budgets, steps)
    data = build_data(g, profile, budgets, DEVICES, HOMES, (0, 1, 2), 2, 0.0, step_counts(g, plan, DEVICES))
    hint = hint_from_plan(data, plan)
    assert len(hint) == sum(not isinstance(s, Free) for s in steps)  # every compute and copy has its event
    tail = [start for sid, (start, _) in hint.items() if data.slots[sid].kind == "copy"]
    assert tail == [data.end]  # after the recompute: among the final copies
    replayed = to_plan(data, hint, SolveResult("hint", "feasible"))
    assert [s for s in replayed.steps if not isinstance(s, Free)] == [s for s in steps if not isinstance(s, Free)]
    assert replayed.predicted.time_s == pytest.approx(plan.predicted.time_s)


def test_a_copied_out_value_is_freed_where_the_hint_frees_it() -> None:
    """fwd_bwd(4), a0 parked over a 2.5 s link (an op takes 1 s) and freed on cpu:0 only after f3, when the copy is
    done: the hint's replay keeps that free, so it runs as the plan does; freed at its last read (f1) instead, f2
    would wait for the copy."""
    g = fwd_bwd(4)
    profile, budgets = with_store(g, latency=0.01, bandwidth=40.0), {"cpu:0": 10**6}
    fwd = [Compute(f"f{k}", "cpu:0") for k in range(4)]
    bwd = [Compute(f"b{k}", "cpu:0") for k in reversed(range(4))]
    out, back = Copy("a0", "cpu:0", "cpu:1"), Copy("a0", "cpu:1", "cpu:0")
    held = [fwd[0], out, fwd[1], fwd[2], fwd[3], Free("a0", "cpu:0"), bwd[0], back, bwd[1], bwd[2], bwd[3]]
    at_once = [fwd[0], out, fwd[1], Free("a0", "cpu:0"), fwd[2], fwd[3], bwd[0], back, bwd[1], bwd[2], bwd[3]]
    plan, eager_free = plan_of(g, profile, budgets, held), plan_of(g, profile, budgets, at_once)
    assert plan.predicted.makespan_s < eager_free.predicted.makespan_s  # the free's place matters here
    order = tuple(g.op_index[o.id] for o in g.ops)
    data = build_data(g, profile, budgets, DEVICES, HOMES, order, 2, 0.0, step_counts(g, plan, DEVICES))
    replayed = to_plan(data, hint_from_plan(data, plan), SolveResult("hint", "feasible"))
    assert replayed.predicted.makespan_s == pytest.approx(plan.predicted.makespan_s)
