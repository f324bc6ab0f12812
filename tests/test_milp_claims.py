"""The stage MILP's "optimal" (its own and the runner's) holds for every plan: on a problem of one device whose graph
order is its only order, or at the lower bound on every plan. Beside a second device its objective over-estimates
plans that overlap across stages, so a one-device plan it proves optimal can be beaten by a two-device plan (a hand
plan's oracle makespan here); with a second order, by a plan whose first computes leave graph order (the exhaustive
optimum here)."""

from __future__ import annotations

import itertools

import pytest
from oracle import makespan as oracle_makespan
from test_milp import GRAPHS, exhaustive_optimum, profile_for

from xsched.contracts.graph import Graph, Op, Value
from xsched.contracts.plan import Compute, Copy, Plan
from xsched.contracts.profile import LinkCost, Profile
from xsched.contracts.result import SolveResult
from xsched.simulate import predicted_plan
from xsched.solve.api import solve_result
from xsched.solve.milp.milp import solve_milp
from xsched.solve.objective import objective_floor
from xsched.solve.options import SolverOptions
from xsched.solve.order.order import single_order, topological
from xsched.solve.problem import Outcome, Problem
from xsched.solve.registry import SolverEntry

QUICK = LinkCost(0.05, 1e6)  # 0.05 s a copy
OPTIONS = SolverOptions(time_limit_s=10.0, mip_gap=0.0)
HOMES = {"x": "a"}


def fork(slower_b: float) -> tuple[Graph, Profile]:
    """x -> fa -> a, x -> fb -> b, (a, b) -> fc -> c: two 1 s branches (device b `slower_b` times slower) and a join."""
    vals = (Value("x", 4, "input"), Value("a", 10), Value("b", 10), Value("c", 4))
    ops = (Op("fa", "t", ("x",), ("a",)), Op("fb", "t", ("x",), ("b",)), Op("fc", "t", ("a", "b"), ("c",)))
    g = Graph("fork", vals, ops, ("c",))
    t = {"fa": 1.0, "fb": 1.0, "fc": 0.1}
    slow = {o: s * slower_b for o, s in t.items()}
    return g, profile_for(g, {"a": t, "b": slow}, {"a->b": QUICK, "b->a": QUICK})


def branches_in_parallel(g: Graph, profile: Profile) -> Plan:
    """The hand plan: fb on b beside fa on a, its output copied back for the join: 0.05 + 1.2 + 0.05 + 0.1 s."""
    steps = (Copy("x", "a", "b"), Compute("fa", "a"), Compute("fb", "b"), Copy("b", "b", "a"), Compute("fc", "a"))
    plan = Plan(g.fingerprint, {}, HOMES, steps, SolveResult("hand", "heuristic"))
    return predicted_plan(g, plan, profile, "the hand plan")


def stage_objective(g: Graph, profile: Profile, plan: Plan) -> float:
    """The stage MILP's objective (seconds) at the stage variables that reproduce `plan`."""
    import pyomo.environ as pyo

    from xsched.solve.milp.extract import plan_to_solution
    from xsched.solve.milp.milp import build_model, set_start
    from xsched.solve.milp.stages import index_stages

    st = index_stages(g, profile, {}, ["a", "b"], HOMES, OPTIONS)
    model = build_model(st, OPTIONS)
    solution = plan_to_solution(st, plan)
    assert solution is not None
    set_start(model, st, solution)
    return pyo.value(model.obj) * st.tu


def test_the_models_one_device_optimum_is_not_claimed_beside_a_faster_two_device_plan() -> None:
    """The model proves the one-device plan (2.1 s) optimal: the stage objective counts the two branches' stages one
    after another (2.35 s) where the hand plan runs them side by side in 1.4 s. Main called it optimal, gap 0, with a
    bound of 2.1 s above a real plan's makespan."""
    g, prof = fork(1.2)
    hand = oracle_makespan(g, branches_in_parallel(g, prof), prof)
    assert hand == pytest.approx(1.4, abs=1e-4)  # 14 B at 1 MB/s beside the latencies
    assert stage_objective(g, prof, branches_in_parallel(g, prof)) == pytest.approx(2.35, abs=1e-4)  # over-counted
    plan = solve_milp(Problem(g, prof, {}, ("a", "b"), HOMES), OPTIONS)
    assert oracle_makespan(g, plan, prof) > hand + 0.5  # the model's optimum: fa, fb, fc on a
    floor, _ = objective_floor(g, prof, ("a", "b"), HOMES)
    assert plan.solver.status == "feasible" and plan.solver.bound == pytest.approx(floor) and floor <= hand
    assert plan.solver.gap == pytest.approx((plan.solver.objective - floor) / plan.solver.objective)
    for method in ("milp", "auto"):
        r = solve_result(g, prof, {}, ["a", "b"], method, OPTIONS, HOMES)
        assert oracle_makespan(g, r.plan, prof) > hand  # no member finds the parallel branches
        assert r.record.status != "optimal" and r.record.bound <= hand + 1e-9 and r.record.gap > 0


def test_a_two_device_plan_at_the_floor_is_optimal() -> None:
    """A chain (fa then fc) has no branches to run side by side: the one-device plan meets the floor on every plan
    (its critical path, 1.1 s), so the claim stands on that bound, not on the model's proof."""
    vals = (Value("x", 4, "input"), Value("a", 10), Value("c", 4))
    g = Graph("chain", vals, (Op("fa", "t", ("x",), ("a",)), Op("fc", "t", ("a",), ("c",))), ("c",))
    t = {"fa": 1.0, "fc": 0.1}
    prof = profile_for(g, {"a": t, "b": t}, {"a->b": QUICK, "b->a": QUICK})
    plan = solve_milp(Problem(g, prof, {}, ("a", "b"), HOMES), OPTIONS)
    floor, _ = objective_floor(g, prof, ("a", "b"), HOMES)
    assert oracle_makespan(g, plan, prof) == pytest.approx(floor) == pytest.approx(1.1)
    assert plan.solver.status == "optimal" and plan.solver.gap == pytest.approx(0.0)


def test_the_runner_takes_an_exact_models_optimal_only_on_one_device(registry) -> None:
    """An exact member alone, proving its one-device plan optimal as main's MILP did: on the two-device problem the
    run says "feasible", its bound the floor below the hand plan's makespan; on device a alone, "optimal"."""
    g, prof = fork(1.2)
    hand = oracle_makespan(g, branches_in_parallel(g, prof), prof)
    steps = (Compute("fa", "a"), Compute("fb", "a"), Compute("fc", "a"))

    def proves(problem: Problem, options: SolverOptions, warm: Plan | None) -> Outcome:
        plan = Plan(g.fingerprint, problem.budgets, HOMES, steps, SolveResult("exact-toy", "optimal"))
        plan = predicted_plan(g, plan, prof, "the toy's plan")
        return Outcome(SolveResult("exact-toy", "optimal", plan.predicted.makespan_s), plan)

    registry.clear()
    registry["exact-toy"] = SolverEntry("exact-toy", proves, kind="exact")
    two = solve_result(g, prof, {}, ["a", "b"], "auto", OPTIONS, HOMES).record
    assert two.found_by == "exact-toy" and two.objective == pytest.approx(2.1) and hand < 2.1
    assert two.status == "feasible" and two.bound <= hand and two.gap > 0
    one = solve_result(g, prof, {}, ["a"], "auto", OPTIONS, HOMES).record
    assert one.status == "optimal" and one.objective == pytest.approx(2.1)


def two_branches() -> Graph:
    """a1 (x -> A, 100 B) read by u1 and a2, b1 (x -> B, 100 B) by b2, and a join: in graph order a1, u1, b1, a2, b2,
    j, so under 120 B graph order computes b1 between A's readers and must remake one of A and B."""
    vals = (Value("x", 4, "input"), *(Value(v, 100 if v in "AB" else 4) for v in "AuBabc"))
    pairs = (("a1", "x", "A"), ("u1", "A", "u"), ("b1", "x", "B"), ("a2", "A", "a"), ("b2", "B", "b"))
    ops = tuple(Op(i, "t", (a,), (b,)) for i, a, b in pairs) + (Op("j", "t", ("a", "b", "u"), ("c",)),)
    return Graph("two-branches", vals, ops, ("c",))


def test_a_one_device_optimum_in_graph_order_is_not_claimed_beside_another_order(registry) -> None:
    """Graph order (a1 u1 b1 a2 b2 j) pays a remake that the order a1 u1 a2 b1 b2 j does not: the model proves 8 s
    (its frontier makes b1's first compute stage 2's, a compute pruning then drops: a 7 s plan), the exhaustive search
    finds 6 s. `proven` said optimal, gap 0, bound 8 s; auto with the MILP alone, optimal with bound 7 s."""
    g = two_branches()
    prof = profile_for(g, {"cpu": {o.id: 1.0 for o in g.ops}})
    budgets, homes = {"cpu": 120}, {"x": "cpu"}
    want = exhaustive_optimum(g, prof, budgets, ["cpu"], homes)
    assert want == pytest.approx(6.0)
    plan = solve_milp(Problem(g, prof, budgets, ("cpu",), homes), OPTIONS)
    info, floor = plan.solver, objective_floor(g, prof, ("cpu",), homes)[0]
    assert oracle_makespan(g, plan, prof) > want + 0.5 and floor <= want
    assert info.stats.model_status == "optimal" and info.stats.model_objective == pytest.approx(8.0)  # its own
    assert info.status == "feasible" and info.bound == pytest.approx(floor) and info.gap > 0
    milp = registry["milp"]
    registry.clear()
    registry["milp"] = milp
    r = solve_result(g, prof, budgets, ["cpu"], "auto", OPTIONS, homes).record
    assert r.found_by == "milp" and r.status == "feasible" and r.bound <= want + 1e-9 and r.gap > 0


def test_auto_still_stops_after_the_models_one_device_proof(registry) -> None:
    """The proof over graph-order plans ends the run on one device (no time for a member after it) without being
    claimed: the member after the MILP is not started."""
    g = two_branches()
    prof = profile_for(g, {"cpu": {o.id: 1.0 for o in g.ops}})
    started: list[str] = []

    def later(problem: Problem, options: SolverOptions, warm: Plan | None) -> Outcome:
        started.append("later")
        return Outcome(SolveResult("later", "no_incumbent"), None)

    milp = registry["milp"]
    registry.clear()
    registry["milp"] = milp
    registry["later"] = SolverEntry("later", later, kind="search")
    r = solve_result(g, prof, {"cpu": 120}, ["cpu"], "auto", OPTIONS, {"x": "cpu"}).record
    assert r.found_by == "milp" and r.status == "feasible" and not started


def orders(g: Graph) -> int:
    """How many topological orders the graph's ops have (counted over every permutation: small graphs only)."""
    return sum(topological(g, order) for order in itertools.permutations(range(len(g.ops))))


@pytest.mark.parametrize("name", [n for n in sorted(GRAPHS) if len(GRAPHS[n].ops) <= 8])
def test_single_order_says_whether_graph_order_is_the_only_order(name: str) -> None:
    g = GRAPHS[name]
    assert single_order(g) == (orders(g) == 1)


def test_the_two_branches_have_more_than_one_order() -> None:
    assert not single_order(two_branches()) and orders(two_branches()) > 1
