"""The simulator: validity errors, memory by hand, times, makespan, and property tests on random DAGs."""

from __future__ import annotations

import pytest
from conftest import chain_graph
from hypothesis import given, settings
from hypothesis import strategies as st

from xsched.contracts.graph import Graph, Op, Value
from xsched.contracts.plan import Compute, Copy, Free, Plan, place_frees
from xsched.contracts.profile import DeviceInfo, LinkCost, OpCost, Profile
from xsched.contracts.result import SolveResult
from xsched.errors import PlanError
from xsched.simulate import simulate
from xsched.solve.reference import eager_plan


def make_plan(g: Graph, steps, homes=None, budgets=None) -> Plan:
    homes = homes or {v: "d" for v in g.inputs}
    return Plan(g.fingerprint, budgets or {}, homes, tuple(steps), SolveResult("test", "heuristic"))


def two_device_profile(g: Graph, t_a=1.0, t_b=1.0, latency=0.5, bw=1.0) -> Profile:
    return Profile(
        g.fingerprint,
        {"a": DeviceInfo("cpu"), "b": DeviceInfo("cpu")},
        {d: {o.id: OpCost(t, energy_j=2 * t) for o in g.ops} for d, t in (("a", t_a), ("b", t_b))},
        {"a->b": LinkCost(latency, bw), "b->a": LinkCost(latency, bw)},
    )


def test_peak_by_hand_on_a_chain():
    # x(8) -> a0(10) -> a1(20) -> a2(30); output a2.
    g = chain_graph([10, 20, 30])
    r = simulate(g, eager_plan(g, "d"))
    # f0: 8 + 10 = 18; f1: 8 + 10 + 20 = 38, then a0 freed -> 28; f2: 28 + 30 = 58, a1 freed -> 38.
    assert r.peak_bytes == {"d": 58}
    assert [m["d"] for m in r.resident_after] == [18, 38, 28, 58, 38]


def test_workspace_counts_during_compute_only():
    vals = (Value("x", 4, "input"), Value("y", 6))
    g = Graph("w", vals, (Op("o", "t", ("x",), ("y",), workspace_bytes=100),), ("y",))
    r = simulate(g, eager_plan(g, "d"))
    assert r.peak_bytes["d"] == 110
    assert r.resident_after[-1]["d"] == 10


def test_missing_compute_names_the_op():
    g = chain_graph([10, 20, 30])
    steps = [s for s in eager_plan(g, "d").steps if not (isinstance(s, Compute) and s.op == "f1")]
    with pytest.raises(PlanError) as e:
        simulate(g, make_plan(g, steps))
    assert e.value.op == "f2" and e.value.value == "a1" and e.value.device == "d"


def test_missing_copy_names_op_value_device():
    g = chain_graph([10, 20])
    steps = [Compute("f0", "a"), Compute("f1", "b")]
    with pytest.raises(PlanError) as e:
        simulate(g, make_plan(g, steps, homes={"x": "a"}))
    assert (e.value.step, e.value.op, e.value.value, e.value.device) == (1, "f1", "a0", "b")


def test_over_budget_names_step_and_device():
    g = chain_graph([10, 20, 30])
    with pytest.raises(PlanError, match="exceeds the budget") as e:
        simulate(g, make_plan(g, eager_plan(g, "d").steps, budgets={"d": 57}))
    assert e.value.device == "d" and e.value.op == "f2"
    simulate(g, make_plan(g, eager_plan(g, "d").steps, budgets={"d": 58}))


def test_never_computed_and_output_missing():
    g = chain_graph([10, 20])
    with pytest.raises(PlanError, match="never computed"):
        simulate(g, make_plan(g, [Compute("f0", "d")]))
    with pytest.raises(PlanError, match="not resident anywhere"):
        simulate(g, make_plan(g, [Compute("f0", "d"), Compute("f1", "d"), Free("a1", "d")]))


def test_input_may_not_be_freed_on_home_and_free_needs_residency():
    g = chain_graph([10])
    with pytest.raises(PlanError, match="freed on its home"):
        simulate(g, make_plan(g, [Compute("f0", "d"), Free("x", "d")]))
    with pytest.raises(PlanError, match="not resident"):
        simulate(g, make_plan(g, [Compute("f0", "d"), Free("a0", "e")]))


def test_param_gradient_must_end_on_home():
    vals = (Value("w", 4, "param"), Value("y", 4), Value("gw", 4, grad_of="w"))
    ops = (Op("f", "t", ("w",), ("y",)), Op("b", "t", ("y", "w"), ("gw",), "bwd"))
    g = Graph("p", vals, ops, ("gw",))
    bad = [Copy("w", "a", "b"), Compute("f", "b"), Compute("b", "b")]
    with pytest.raises(PlanError, match="must end on a"):
        simulate(g, make_plan(g, bad, homes={"w": "a"}))
    simulate(g, make_plan(g, [*bad, Copy("gw", "b", "a")], homes={"w": "a"}))


def test_copy_counts_on_destination_and_times_add_up():
    g = chain_graph([10, 20])
    p = two_device_profile(g, t_a=1.0, t_b=3.0, latency=0.5, bw=10.0)
    steps = [Compute("f0", "a"), Copy("a0", "a", "b"), Compute("f1", "b")]
    r = simulate(g, make_plan(g, place_frees(g, steps, {"x": "a"}), homes={"x": "a"}), p)
    assert r.peak_bytes == {"a": 18, "b": 30}
    assert r.time_s == pytest.approx(1.0 + (0.5 + 10 / 10.0) + 3.0)
    assert r.energy_j == pytest.approx(2 * 1.0 + 2 * 3.0)
    assert r.copies == 1 and r.copy_bytes == 10


def test_makespan_overlaps_independent_streams():
    # Two independent branches from x: one on a, one on b (x copied first); they overlap.
    vals = (Value("x", 1, "input"), Value("p", 1), Value("q", 1))
    g = Graph("fork", vals, (Op("o1", "t", ("x",), ("p",)), Op("o2", "t", ("x",), ("q",))), ("p", "q"))
    prof = two_device_profile(g, t_a=4.0, t_b=4.0, latency=1.0, bw=1e12)
    steps = [Copy("x", "a", "b"), Compute("o1", "a"), Compute("o2", "b")]
    r = simulate(g, make_plan(g, steps, homes={"x": "a"}), prof)
    assert r.time_s == pytest.approx(9.0)
    assert r.makespan_s == pytest.approx(5.0)  # o1 runs 0..4 while the copy (0..1) then o2 (1..5) run
    assert r.step_span[2] == pytest.approx((1.0, 5.0))


def test_no_profile_entry_means_cannot_run():
    g = chain_graph([10])
    p = Profile(g.fingerprint, {"a": DeviceInfo("cpu")}, {"a": {}})
    with pytest.raises(PlanError, match="cannot run") as e:
        simulate(g, make_plan(g, [Compute("f0", "a")], homes={"x": "a"}), p)
    assert e.value.op == "f0"


def test_wrong_graph_fingerprint():
    g = chain_graph([10])
    plan = eager_plan(chain_graph([11]), "d")
    with pytest.raises(PlanError, match="plan is for graph"):
        simulate(g, plan)


def test_plan_json_round_trip(tmp_path):
    g = chain_graph([10, 20], train=True)
    plan = eager_plan(g, "d")
    plan.save(tmp_path / "p.json")
    again = Plan.load(tmp_path / "p.json")
    assert again == plan
    assert simulate(g, again).peak_bytes == simulate(g, plan).peak_bytes


def test_boundary_of_training_plan():
    g = chain_graph([10, 20], train=True)
    plan = eager_plan(g, "d")
    first_bwd = next(i for i, s in enumerate(plan.steps) if isinstance(s, Compute) and s.op.startswith("b"))
    assert plan.boundary == first_bwd
    assert eager_plan(chain_graph([10, 20]), "d").boundary is None


# ---- property tests on random DAGs ----
@st.composite
def random_dags(draw) -> Graph:
    n_inputs = draw(st.integers(1, 3))
    n_ops = draw(st.integers(1, 12))
    values = [Value(f"in{i}", draw(st.integers(0, 50)), "input") for i in range(n_inputs)]
    ops = []
    for k in range(n_ops):
        avail = [v.id for v in values]
        ins = draw(st.lists(st.sampled_from(avail), min_size=0, max_size=3, unique=True))
        outs = [f"v{k}_{j}" for j in range(draw(st.integers(1, 2)))]
        values += [Value(o, draw(st.integers(0, 50))) for o in outs]
        ops.append(Op(f"o{k}", "t", tuple(ins), tuple(outs), workspace_bytes=draw(st.integers(0, 5))))
    produced = [v.id for v in values if not v.id.startswith("in")]
    outputs = draw(st.lists(st.sampled_from(produced), max_size=3, unique=True))
    return Graph("rand", tuple(values), tuple(ops), tuple(outputs))


def hand_peak(g: Graph) -> int:
    """Independent count of the eager peak: live sets recomputed from scratch at every op."""
    last_use = {}
    for i, o in enumerate(g.ops):
        for v in o.inputs:
            last_use[v] = i
    peak = sum(g.value[v].nbytes for v in g.inputs)
    for i, o in enumerate(g.ops):
        live = set(g.inputs)
        for j, p in enumerate(g.ops[:i]):
            for v in p.outputs:
                if v in g.outputs or last_use.get(v, j) >= i:
                    live.add(v)
        during = sum(g.value[v].nbytes for v in live) + sum(g.value[v].nbytes for v in o.outputs) + o.workspace_bytes
        peak = max(peak, during)
    return peak


@settings(max_examples=150, deadline=None)
@given(random_dags())
def test_eager_plan_always_valid_and_peak_matches_hand_count(g):
    r = simulate(g, eager_plan(g, "d"))
    assert r.peak_bytes["d"] == hand_peak(g)
    assert r.computes == len(g.ops)
    # At the end only the inputs and the graph outputs are resident.
    assert r.resident_after[-1]["d"] == sum(g.value[v].nbytes for v in set(g.inputs) | set(g.outputs))


@settings(max_examples=150, deadline=None)
@given(random_dags(), st.data())
def test_dropping_a_needed_compute_is_caught_and_named(g, data):
    plan = eager_plan(g, "d")
    k = data.draw(st.integers(0, len(g.ops) - 1))
    dropped = g.ops[k]
    steps = [s for s in plan.steps if not (isinstance(s, Compute) and s.op == dropped.id)]
    steps = [s for s in steps if not (isinstance(s, Free) and s.value in dropped.outputs)]
    readers = [o for o in g.ops if set(o.inputs) & set(dropped.outputs)]
    with pytest.raises(PlanError) as e:
        simulate(g, make_plan(g, steps))
    if readers:
        assert e.value.op == readers[0].id and e.value.value in dropped.outputs
    else:
        assert e.value.op == dropped.id or e.value.value in dropped.outputs


@settings(max_examples=100, deadline=None)
@given(random_dags(), st.data())
def test_two_device_split_with_copies_is_valid_and_dropping_a_copy_is_named(g, data):
    where = {o.id: data.draw(st.sampled_from(["a", "b"])) for o in g.ops}
    homes = {v: "a" for v in g.inputs}
    resident = {(v, "a") for v in g.inputs}
    steps = []
    for o in g.ops:
        d = where[o.id]
        for v in o.inputs:
            if (v, d) not in resident:
                src = next(s for s in ("a", "b") if (v, s) in resident)
                steps.append(Copy(v, src, d))
                resident.add((v, d))
        steps.append(Compute(o.id, d))
        resident |= {(v, d) for v in o.outputs}
    plan = make_plan(g, place_frees(g, steps, homes), homes=homes)
    r = simulate(g, plan)
    assert set(r.peak_bytes) <= {"a", "b"}
    copies = [i for i, s in enumerate(plan.steps) if isinstance(s, Copy)]
    if copies:
        i = data.draw(st.sampled_from(copies))
        c = plan.steps[i]
        rest = [
            s for j, s in enumerate(plan.steps) if j != i and not (isinstance(s, Free) and s == Free(c.value, c.dst))
        ]
        with pytest.raises(PlanError) as e:
            simulate(g, make_plan(g, rest, homes=homes))
        assert e.value.value == c.value


def test_random_op_rerun_must_draw_from_the_same_rng():
    """A random op first run on the CPU may be recomputed on another logical CPU, not on a GPU."""
    g = Graph(
        "draw",
        (Value("m", 8), Value("p", 4)),
        (Op("r", "aten.rand.default", (), ("m",)), Op("b", "aten.sum.default", ("m",), ("p",))),
        ("p",),
    )

    def rerun_on(dev: str) -> Plan:
        return make_plan(g, [Compute("r", "cpu:0"), Free("m", "cpu:0"), Compute("r", dev), Compute("b", dev)], {})

    simulate(g, rerun_on("cpu:1"))
    with pytest.raises(PlanError, match="cannot be replayed") as e:
        simulate(g, rerun_on("cuda:0"))
    assert (e.value.op, e.value.step, e.value.device) == ("r", 2, "cuda:0")
