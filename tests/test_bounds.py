"""Memory lower bounds: sound (no valid plan beats them), tight where hand-countable, and clear errors below them."""

from __future__ import annotations

import itertools

import pytest
from conftest import BENCH, chain_graph
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_heuristics import DEVICES, HEURISTICS, train_dags, two_device_profile
from test_milp import exhaustive_optimum, profile_for, times_of

from xsched.budgets import format_bytes
from xsched.contracts.graph import Graph, Op, Value
from xsched.errors import BudgetError, ProfileError
from xsched.importers import import_networkx
from xsched.simulate import simulate
from xsched.solve.bounds.memory import check_budgets, lower_bounds
from xsched.solve.problem import Problem
from xsched.solve.reference import eager_peak


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(train_dags(), st.data())
def test_bounds_are_sound_and_never_reject_budgets_a_heuristic_meets(g, data):
    b_runs = data.draw(st.sampled_from([lambda o: True, lambda o: o.phase == "fwd", lambda o: False]))
    profile = two_device_profile(g, b_runs=b_runs)
    homes = {v: data.draw(st.sampled_from(DEVICES)) for v in g.inputs}
    bounds = lower_bounds(g, profile, DEVICES, homes)
    budgets = {d: data.draw(st.integers(0, 2 * eager_peak(g) + 50)) for d in DEVICES}
    for fn in HEURISTICS.values():
        for b in ({}, budgets):
            try:
                plan = fn(Problem(g, profile, b, DEVICES, homes))
            except BudgetError:
                continue
            peaks = simulate(g, plan, profile).peak_bytes
            for d in DEVICES:
                assert peaks.get(d, 0) >= bounds[d].bytes, (d, bounds[d])
            check_budgets(g, profile, b, DEVICES, homes)  # a plan exists, so the check must pass


@settings(max_examples=80, deadline=None)
@given(train_dags())
def test_one_device_bound_holds_the_largest_op_what_must_stay_and_every_output(g):
    """At least the simple bounds: the largest op, the gradients held while the last is made, and every graph
    output at the end (with one device, all must end there). The crossing bound may add to them; its soundness
    is checked against exhaustive search below."""
    homes = {v: "a" for v in g.inputs}
    homed = sum(g.value[v].nbytes for v in g.inputs)
    biggest = max(
        sum(g.value[v].nbytes for v in (set(o.inputs) | set(o.outputs)) - set(g.inputs)) + o.workspace_bytes
        for o in g.ops
    )
    outputs = sum(g.value[v].nbytes for v in set(g.outputs) - set(g.inputs))
    bound = lower_bounds(g, None, ["a"], homes)["a"]
    simple = homed + max(biggest, last_output_by_every_order(g))
    assert bound.bytes >= max(simple, homed + outputs)
    assert bound.bytes == simple or (bound.by == "crossing" and "ops needing at least" in bound.reason)


def last_output_by_every_order(g: Graph) -> int:
    """Over every order in which the gradients (each resident from its last making to the end) are made last: the
    least, over orders, of the most held while one is made (those made before it, its op's own need, counting the
    gradients it reads or makes apart). The bound takes the sorted order; this tries them all."""
    grads = {v.id: v.nbytes for v in g.values if v.grad_of}
    extra = {}
    for v in grads:
        op = g.ops[g.op_index[g.producer[v]]]
        own = (set(op.inputs) | set(op.outputs)) - set(g.inputs)
        extra[v] = sum(g.value[u].nbytes for u in own if u not in grads) + op.workspace_bytes
    return (
        min(
            max(sum(grads[u] for u in order[: k + 1]) + extra[v] for k, v in enumerate(order))
            for order in itertools.permutations(grads)
        )
        if grads
        else 0
    )


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(train_dags(max_ops=3))
def test_one_device_bound_never_exceeds_the_least_budget_exhaustive_search_meets(g: Graph) -> None:
    """Against an independent answer: the least budget for which the exhaustive search (every step sequence by the
    simulator's rules) finds a plan, on small training graphs whose gradients' producers read other values."""
    prof = profile_for(g, {"cpu": times_of(g)})
    homes = {v: "cpu" for v in g.inputs}
    bound = lower_bounds(g, prof, ["cpu"], homes)["cpu"].bytes
    with pytest.raises(AssertionError, match="no plan"):  # the bound is sound: no step sequence peaks below it
        exhaustive_optimum(g, prof, {"cpu": bound - 1}, ["cpu"], homes)


def test_the_crossing_bound_beats_the_simple_ones_and_exhaustive_search_meets_it_exactly():
    """Every op runs at least once, so one of o0 (needs 20 B) and o1 (29 B) runs last. If o1: p0's gradient, or
    v0_0 that it reads, is held beside o1 (+3 B). If o0: the output v1_0 (+13 B). So 38 homed + 32 = 70 B, where
    the simple bounds say 67 (o1's need), and exhaustive search over every step sequence finds no plan below 70."""
    vals = [Value("in0", 1, "input"), Value("in1", 34, "input"), Value("p0", 3, "param")]
    vals += [Value("v0_0", 15), Value("v1_0", 13), Value("v1_1", 15), Value("g_p0", 3, grad_of="p0")]
    ops = (
        Op("o0", "t", (), ("v0_0",), workspace_bytes=5),
        Op("o1", "t", ("in0", "p0", "in1"), ("v1_0", "v1_1"), "bwd", workspace_bytes=1),
        Op("grad_p0", "t", ("v0_0",), ("g_p0",), "bwd"),
    )
    g = Graph("crossing", tuple(vals), ops, ("v1_0", "g_p0"))
    homes = {v: "cpu" for v in g.inputs}
    prof = profile_for(g, {"cpu": times_of(g)})
    bound = lower_bounds(g, prof, ["cpu"], homes)["cpu"]
    assert 38 + max(29, last_output_by_every_order(g), 13 + 3) == 67 and bound.bytes == 70, bound
    assert "last of the 2 ops needing at least" in bound.reason and bound.op == "o1" and bound.by == "crossing"
    exhaustive_optimum(g, prof, {"cpu": 70}, ["cpu"], homes)  # a plan at the bound exists
    with pytest.raises(AssertionError, match="no plan"):
        exhaustive_optimum(g, prof, {"cpu": 69}, ["cpu"], homes)


def test_budget_below_the_bound_names_device_bound_and_op():
    g = chain_graph([10, 500, 5])
    bound = lower_bounds(g, None, ["d"], {"x": "d"})["d"]
    assert bound.bytes == 8 + 10 + 500 and bound.op == "f1"
    check_budgets(g, None, {"d": bound.bytes}, ["d"], {"x": "d"})
    with pytest.raises(BudgetError) as e:
        check_budgets(g, None, {"d": bound.bytes - 1}, ["d"], {"x": "d"})
    assert e.value.device == "d" and e.value.op == "f1"
    assert format_bytes(bound.bytes) in str(e.value) and "f1" in str(e.value) and "d needs at least" in str(e.value)


def test_op_that_fits_nowhere_lists_every_device():
    g = chain_graph([10, 500, 5])
    profile = two_device_profile(g)
    with pytest.raises(BudgetError, match="no device can run op f1") as e:
        check_budgets(g, profile, {"a": 300, "b": 400}, DEVICES, {"x": "a"})
    msg = str(e.value)
    assert f"a needs at least {format_bytes(518)}" in msg and f"b needs at least {format_bytes(510)}" in msg
    assert e.value.op == "f1" and e.value.device == "b"  # b is the closest to fitting
    check_budgets(g, profile, {"a": 300, "b": 510}, DEVICES, {"x": "a"})


def test_op_bound_only_on_the_device_that_alone_can_run_it():
    g = chain_graph([10, 500, 5])
    profile = two_device_profile(g, b_runs=lambda o: o.id != "f1")
    bounds = lower_bounds(g, profile, DEVICES, {"x": "b"})
    assert bounds["a"].bytes == 510 and bounds["a"].op == "f1" and "can run only on a" in bounds["a"].reason
    assert bounds["b"].bytes == 8 and bounds["b"].op is None


def test_param_gradient_must_fit_at_home():
    x, w = Value("x", 8, "input"), Value("w", 100, "param")
    y, gw = Value("y", 8), Value("gw", 100, grad_of="w")
    g = Graph("g", (x, w, y, gw), (Op("f", "t", ("x", "w"), ("y",)), Op("b", "t", ("y", "x"), ("gw",), "bwd")), ("gw",))
    bound = lower_bounds(g, two_device_profile(g), DEVICES, {"x": "b", "w": "a"})["a"]
    assert bound.bytes == 200 and "outputs that must end there" in bound.reason


def test_bad_homes_and_unrunnable_ops_are_named():
    g = chain_graph([10, 20])
    with pytest.raises(BudgetError, match="not among the devices") as e:
        check_budgets(g, None, {}, ["a"], {"x": "gpu"})
    assert e.value.value == "x" and e.value.device == "gpu"
    profile = two_device_profile(g, b_runs=lambda o: False)
    with pytest.raises(ProfileError, match="cannot run on any of b") as e:
        check_budgets(g, profile, {}, ["b"], {"x": "b"})
    assert e.value.op == "f0"


@pytest.mark.parametrize("name", ["random_layered_n100", "checkmate_vgg16_train"])
def test_bench_bounds_below_the_eager_peak(name):
    g, profile = import_networkx(BENCH / f"{name}.json")
    b = lower_bounds(g, profile, ["bench"], {})["bench"]
    assert 0 < b.bytes <= eager_peak(g)
    assert b.bytes == max(g.op_bytes(o.id) for o in g.ops)


def test_time_bounds_by_hand() -> None:
    """f0 runs only on the CPU (1 s), f1 on both (3 s / 1 s), f2 only on the GPU (2 s) and reads x (100 B, homed on
    the CPU) over a 10 B/s link with 0.5 s latency. x must cross the link (10.5 s) before f2 runs (2 s): the
    critical path, copies counted, is 12.5 s (with x on the GPU, 1 + 1 + 2 = 4 s), which the plan that copies x
    first meets. The CPU must run f0, and f1 too in a step under 4.6 s (its chain on the GPU is 1 + 0.6 for b's copy
    + 1 + 2 s): 4 s. The GPU must run f2, and f1 too in a step under 6 s (its chain on the CPU is 1 + 3 + 2 s): 3 s.
    The work spread over both is 2 s, the link's load 10.5 s, and the phases around f2 see that f2 starts once x is
    in: 12.5 s (a margin below)."""
    from xsched.contracts.graph import Graph, Op, Value
    from xsched.contracts.profile import DeviceInfo, LinkCost, OpCost, Profile
    from xsched.solve.bounds.time import time_bound, time_bounds

    g = Graph(
        "bounds",
        (Value("x", 100, "input"), Value("a", 1), Value("b", 1), Value("c", 1)),
        (Op("f0", "t", (), ("a",)), Op("f1", "t", ("a",), ("b",)), Op("f2", "t", ("b", "x"), ("c",))),
        ("c",),
    )
    compute = {"cpu": {"f0": OpCost(1.0), "f1": OpCost(3.0)}, "gpu": {"f1": OpCost(1.0), "f2": OpCost(2.0)}}
    link = LinkCost(0.5, 10.0)
    devices = {"cpu": DeviceInfo("cpu"), "gpu": DeviceInfo("cuda")}
    prof = Profile(g.fingerprint, devices, compute, {"cpu->gpu": link, "gpu->cpu": link})
    found = {b.by: b.seconds for b in time_bounds(g, prof, ["cpu", "gpu"], {"x": "cpu"})}
    want = {"critical path": 12.5, "compute on cpu": 4.0, "compute on gpu": 3.0, "link cpu->gpu": 10.5}
    assert found == pytest.approx({**want, "compute spread over 2 devices": 2.0, "phases around f2": 12.5}, rel=1e-5)
    assert time_bound(g, prof, ["cpu", "gpu"], {"x": "cpu"}).seconds == pytest.approx(12.5)
    # x there already: f0's a (or f1's b) still crosses, 1 + 0.6 + 1 + 2 s, as the best plan takes
    assert time_bound(g, prof, ["cpu", "gpu"], {"x": "gpu"}).seconds == pytest.approx(4.6)


def test_ops_no_other_device_can_fit_bound_the_device_and_exhaustive_search_meets_it() -> None:
    """x (homed on g) feeds f1 and f2, whose outputs f3 joins; each runs in 1 s on g, and f1 and f2 in 10 s on c
    (f3 only on g). The critical path is 2 s and only f3 must run on g (1 s), but in any step under 11 s f1 and f2
    run on g too (either on c makes a chain of 10 + 1 s): g computes 3 s one after another, and no plan is faster
    (an exhaustive search over step sequences, makespans by the oracle's sweep)."""
    from test_bounds_phases import least_makespan

    from xsched.contracts.profile import DeviceInfo, LinkCost, OpCost, Profile
    from xsched.solve.bounds.time import time_bound, time_bounds

    values = (Value("x", 1, "input"), Value("a", 1), Value("b", 1), Value("y", 1))
    ops = (Op("f1", "t", ("x",), ("a",)), Op("f2", "t", ("x",), ("b",)), Op("f3", "t", ("a", "b"), ("y",)))
    g = Graph("fork", values, ops, ("y",))
    compute = {"g": {o.id: OpCost(1.0) for o in ops}, "c": {"f1": OpCost(10.0), "f2": OpCost(10.0)}}
    link = LinkCost(0.0, 1e9)
    infos = {"g": DeviceInfo("cuda"), "c": DeviceInfo("cpu")}
    prof = Profile(g.fingerprint, infos, compute, {"g->c": link, "c->g": link})
    found = {b.by: b.seconds for b in time_bounds(g, prof, ["g", "c"], {"x": "g"})}
    assert found["critical path"] == pytest.approx(2.0) and found["compute on g"] == pytest.approx(3.0)
    assert time_bound(g, prof, ["g", "c"], {"x": "g"}).by == "compute on g"
    assert least_makespan(g, prof, {}, ["g", "c"], {"x": "g"}, below=10.0, runs=1, depth=9) == pytest.approx(3.0)
