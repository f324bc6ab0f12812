"""auto keeps the incumbent a member starts from when the member's plan breaks wrap's autograd boundary rule or the
budgets (the runner's fall-back), and the interval model holds the rule itself, so its refinements are not dropped:
on GPT-2 at 45% of the H100 profile intervals-cpsat's refinement of hier's plan broke it and auto returned hier's
plan unrefined (1.600x at 60 s where 20 s gave 1.287x). Oracles: the rule's own checker (missing_at_boundary) and an
exhaustive search over every step sequence that keeps the rule (test_held_solvers.held_optimum)."""

from __future__ import annotations

import pytest
from oracle import assert_prediction_matches
from test_held_solvers import held_optimum
from test_milp import exhaustive_optimum, profile_for

from xsched.contracts.graph import Graph, Op, Value
from xsched.contracts.plan import Compute, Free, Plan, Step, autograd_boundary
from xsched.contracts.profile import Profile
from xsched.contracts.result import SolveResult
from xsched.errors import BudgetError
from xsched.simulate import simulate
from xsched.solve import SolverEntry, SolverOptions, solve
from xsched.solve.autograd_boundary import missing_at_boundary
from xsched.solve.intervals.solver import solve_intervals
from xsched.solve.problem import Outcome, Problem, validated

HOMES = {"x": "cpu", "t": "cpu"}  # 12 B of inputs
ONE = SolverOptions(time_limit_s=10, solver_threads=1)  # the model is solved to optimality in well under that


def returned_graph() -> tuple[Graph, Profile]:
    """forward: f1 x -> h (100 B, 3 s), f2 h -> o (100 B, 1 s), o a graph output that wrap returns when backward
    starts; backward: b1 t -> g1 (200 B), b2 (g1, h) -> gx (8 B). Below 412 B, holding o at b1 means freeing h
    there and computing f1 again for b2 (10 s); freeing o before b1 and computing f2 again at the end (7 s in this
    order) breaks the rule."""
    values = (Value("x", 8, "input"), Value("t", 4, "tangent"), Value("h", 100), Value("o", 100))
    values += (Value("g1", 200), Value("gx", 8))
    ops = (
        Op("f1", "t", ("x",), ("h",), "fwd"),
        Op("f2", "t", ("h",), ("o",), "fwd"),
        Op("b1", "t", ("t",), ("g1",), "bwd"),
        Op("b2", "t", ("g1", "h"), ("gx",), "bwd"),
    )
    g = Graph("returned", values, ops, ("o", "gx"), forward_outputs=({"ref": "o"},))
    return g, profile_for(g, {"cpu": {"f1": 3.0, "f2": 1.0, "b1": 1.0, "b2": 1.0}})


def hand_plan(g: Graph, steps: list[Step], budget: int, method: str) -> Plan:
    """A plan of these steps on cpu, unchecked (a member's raw plan)."""
    return Plan(g.fingerprint, {"cpu": budget}, HOMES, tuple(steps), SolveResult(method, "feasible"),
                boundary=autograd_boundary(g, steps))  # fmt: skip


def C(op: str) -> Compute:
    return Compute(op, "cpu")


def F(value: str) -> Free:
    return Free(value, "cpu")


# o held at b1, h computed again for b2: 10 s, peak 308 B + inputs
KEEPS = [C("f1"), C("f2"), F("h"), C("b1"), F("o"), C("f1"), C("b2"), F("g1"), C("f2"), F("h")]
# o freed before b1, made again at the end: 7 s, peak 308 B + inputs; wrap could not run it, and computing o
# before b1 (the repair) holds h, o and g1 there: 400 B + inputs
BREAKS = [C("f1"), C("f2"), F("o"), C("b1"), C("b2"), F("g1"), C("f2"), F("h")]
# nothing freed before b2: 6 s, peak 408 B + inputs
OVER = [C("f1"), C("f2"), C("b1"), C("b2"), F("g1")]


def member(plan_of, calls: list) -> SolverEntry:
    """A timed member returning `plan_of(budget)` as its own, recording the warm start it was given."""

    def run(problem: Problem, options: SolverOptions, warm: Plan | None) -> Outcome:
        calls.append(warm)
        plan = plan_of(problem.budgets["cpu"])
        return Outcome(plan.solver, plan)

    return run


@pytest.mark.parametrize("bad", ["breaks the rule", "over the budget"])
def test_a_refinement_that_auto_cannot_use_leaves_the_warm_incumbent(registry, bad: str) -> None:
    """At 360 B a first member finds the 10 s plan; a second, warm-started from it, returns a faster plan that auto
    must refuse (breaking the boundary rule past repair, or over the budget): auto returns the first plan, with the
    second member's outcome "failed" saying why, and its plan is an independent count's within the budget."""
    g, prof = returned_graph()
    budget = 360
    steps = BREAKS if bad == "breaks the rule" else OVER
    assert missing_at_boundary(g, hand_plan(g, BREAKS, budget, "x")) == ["o"]  # the rule's own checker
    assert simulate(g, hand_plan(g, OVER, 10**6, "x"), prof).peak_bytes["cpu"] > budget
    for name in list(registry):
        del registry[name]
    first, second = [], []
    registry["first"] = SolverEntry("first", member(lambda b: hand_plan(g, KEEPS, b, "first"), first), kind="search")
    registry["second"] = SolverEntry("second", member(lambda b: hand_plan(g, steps, b, "second"), second), "search")
    plan = solve(g, prof, {"cpu": budget}, ["cpu"], "auto", SolverOptions(time_limit_s=5), homes=HOMES)
    outcomes = {m.method: m for m in plan.solver.stats.members}
    assert second and second[0] is not None and second[0].steps == plan.steps  # it started from the incumbent
    assert plan.solver.found_by == "first" and plan.steps == tuple(KEEPS)
    assert outcomes["second"].status == "failed" and outcomes["second"].objective is None
    want = "not resident when backward starts" if bad == "breaks the rule" else "budget"
    assert want in outcomes["second"].message
    assert plan.predicted.time_s == pytest.approx(10.0) and not missing_at_boundary(g, plan)
    assert_prediction_matches(g, plan, prof, {"cpu": budget})


def test_the_interval_model_holds_forward_outputs_at_the_boundary() -> None:
    """At every budget the exhaustive search with the rule has a plan, the interval model's plan keeps the rule
    (its own checker; validated repairs nothing) and is that optimum (one device; graph order is the only order in
    which o exists when backward starts); where it has none, the model proves it (BudgetError). The rule costs time
    here (the search without it is faster), so a model ignoring it would not meet the oracle."""
    g, prof = returned_graph()
    homes = HOMES
    dearer = False
    for budget in (420, 416, 400, 360, 320, 316):
        problem = Problem(g, prof, {"cpu": budget}, ["cpu"], homes)
        try:
            want = held_optimum(g, prof, budget, homes)
        except AssertionError:
            with pytest.raises(BudgetError, match="interval model"):
                solve_intervals(problem, ONE)
            continue
        plan = solve_intervals(problem, ONE)
        assert missing_at_boundary(g, plan) == [], budget
        assert validated(g, plan, prof, {"cpu": budget}).solver.repaired == ()
        assert_prediction_matches(g, plan, prof, {"cpu": budget})
        assert plan.predicted.time_s == pytest.approx(want), budget
        dearer |= exhaustive_optimum(g, prof, {"cpu": budget}, ["cpu"], homes) < want - 1e-9
    assert dearer


def test_intervals_cpsat_refines_a_warm_start_within_the_rule(registry) -> None:
    """At 416 B auto's intervals-cpsat, warm-started from the 10 s plan (a first member's), finds the 7 s optimum
    with the rule (f2 computed again at the end, o held at b1) instead of a plan that breaks it and is dropped."""
    g, prof = returned_graph()
    budget = 416
    want = held_optimum(g, prof, budget, HOMES)
    assert want == pytest.approx(7.0)
    for name in [n for n in registry if n != "intervals-cpsat"]:
        del registry[name]
    registry["first"] = SolverEntry("first", member(lambda b: hand_plan(g, KEEPS, b, "first"), []), kind="search")
    registry["intervals-cpsat"] = registry.pop("intervals-cpsat")  # after the first, in registration order
    options = SolverOptions(time_limit_s=20, solver_threads=1)
    plan = solve(g, prof, {"cpu": budget}, ["cpu"], "auto", options, homes=HOMES)
    outcomes = {m.method: m for m in plan.solver.stats.members}
    assert outcomes["intervals-cpsat"].status != "failed", outcomes["intervals-cpsat"].message
    assert plan.solver.found_by == "intervals-cpsat" and plan.predicted.time_s == pytest.approx(want)
    assert missing_at_boundary(g, plan) == [] and plan.solver.repaired == ()
    assert_prediction_matches(g, plan, prof, {"cpu": budget})
