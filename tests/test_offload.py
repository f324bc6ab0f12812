"""Offloading (xsched.solve.heuristics.offload): gaps by hand, parking plans within both budgets and checked by the
simulator, prefetch that hides copies, clear failures, and the executor against eager PyTorch on a parked plan."""

from __future__ import annotations

import pytest
from executor_support import TWO, check_against_eager, split_homes, unit_profile, workload

from xsched.budgets import parse_budgets
from xsched.contracts.graph import Graph, Op, Value
from xsched.contracts.plan import Compute, Copy
from xsched.contracts.profile import DeviceInfo, LinkCost, OpCost, Profile
from xsched.errors import BudgetError
from xsched.simulate import simulate
from xsched.solve import solve
from xsched.solve.heuristics.offload import offload_search, widest_gaps
from xsched.solve.problem import Problem
from xsched.solve.reference import eager_peak

pytestmark = pytest.mark.usefixtures("one_thread")


def fwd_bwd(n: int, size: int = 100) -> Graph:
    """A chain f0..f{n-1} and a mirrored backward b{n-1}..b0, where b_k reads f_k's output and the gradient
    so far: every forward activation is saved from its forward op until its backward op."""
    values = [Value("x", size, "input")] + [Value(f"a{k}", size) for k in range(n)]
    values += [Value(f"g{k}", size) for k in range(n)]
    ops = [Op(f"f{k}", "t", ("x" if k == 0 else f"a{k - 1}",), (f"a{k}",)) for k in range(n)]
    for k in reversed(range(n)):
        grad_in = f"a{n - 1}" if k == n - 1 else f"g{k + 1}"
        ops.append(Op(f"b{k}", "t", tuple(dict.fromkeys((grad_in, f"a{k}"))), (f"g{k}",), "bwd"))
    return Graph("fwd_bwd", tuple(values), tuple(ops), ("g0",))


def two_cpus(g: Graph, op_s: float = 1.0, latency: float = 0.01, bandwidth: float = 1000.0) -> Profile:
    return Profile(
        g.fingerprint,
        {d: DeviceInfo("cpu") for d in TWO},
        {d: {o.id: OpCost(op_s) for o in g.ops} for d in TWO},
        {"cpu:0->cpu:1": LinkCost(latency, bandwidth), "cpu:1->cpu:0": LinkCost(latency, bandwidth)},
    )


def test_gaps_are_the_widest_stretch_between_uses() -> None:
    g = fwd_bwd(3)
    computes = [Compute(o.id, "cpu:0") for o in g.ops]  # f0 f1 f2 b2 b1 b0
    # a0 is read by f1 (1) and then b0 (5), a1 by f2 (2) and b1 (4); a2 and the g's are read right away
    assert sorted(widest_gaps(g, computes, {"x": "cpu:0"})) == [(1, 5, "a0"), (2, 4, "a1")]


def test_parks_saved_activations_on_the_other_device_within_both_budgets() -> None:
    g = fwd_bwd(8)
    profile = two_cpus(g)
    half = eager_peak(g) // 2
    plan = solve(g, profile, {"cpu:0": half, "cpu:1": half}, TWO, "offload", homes={"x": "cpu:0"})
    sim = simulate(g, plan, profile)
    assert sim.peak_bytes["cpu:0"] <= half and sim.peak_bytes["cpu:1"] <= half
    (c,) = {s.device for s in plan.steps if isinstance(s, Compute)}
    assert sum(isinstance(s, Compute) for s in plan.steps) == len(g.ops), "parking alone fits: no recompute"
    out = [s.value for s in plan.steps if isinstance(s, Copy) and s.src == c]
    back = [s.value for s in plan.steps if isinstance(s, Copy) and s.dst == c and s.value != "x"]
    assert out and sorted(out) == sorted(back) == sorted(set(out))  # each parked value goes out once, back once
    assert plan.solver.stats.parked == len(out)


def test_prefetch_hides_the_copies_behind_compute() -> None:
    """Copies take a tenth of an op: issued a few ops early, they overlap compute, so the overlapped makespan
    is shorter than the sequential time by about their total."""
    g = fwd_bwd(12)
    profile = two_cpus(g, op_s=1.0, latency=0.1, bandwidth=1e9)
    peak = eager_peak(g)
    plan = solve(g, profile, {"cpu:0": peak // 2, "cpu:1": peak // 2}, TWO, "offload", homes={"x": "cpu:0"})
    sim = simulate(g, plan, profile)
    copy_s = sum(0.1 for s in plan.steps if isinstance(s, Copy))
    assert plan.solver.stats.prefetch_ops > 0
    assert sim.makespan_s == pytest.approx(sim.time_s - copy_s, abs=0.11)  # at most one copy left exposed


def test_clear_failures() -> None:
    g = fwd_bwd(6)
    profile = two_cpus(g)
    peak = eager_peak(g)
    with pytest.raises(BudgetError, match="two devices"):
        solve(g, profile, {"cpu:0": peak}, ("cpu:0",), "offload", homes={"x": "cpu:0"})
    # cpu:0 cannot run b_k (300 B) beside x (homed there); cpu:1 can, only by parking more than cpu:0 has left
    with pytest.raises(BudgetError, match="cpu:0, even parking every gap; .*must park to fit overflows cpu:0"):
        offload_search(Problem(g, profile, {"cpu:0": 350, "cpu:1": 350}, TWO, {"x": "cpu:0"}))
    nolink = Profile(g.fingerprint, profile.devices, profile.compute, {})
    with pytest.raises(BudgetError, match="no copy link"):
        offload_search(Problem(g, nolink, {"cpu:0": peak // 2, "cpu:1": peak}, TWO, {"x": "cpu:0"}))


def test_parked_plan_of_a_zoo_model_matches_eager_pytorch() -> None:
    """gpt2 at 50% on each of two logical CPUs, params homed on cpu:1: every value parked and fetched back gives
    eager's outputs and gradients, and the resident bytes after every step are the simulator's."""
    graph = workload("gpt2")[1]
    budgets = parse_budgets({d: "50%" for d in TWO}, eager_peak(graph))
    plan = solve(graph, unit_profile(graph, TWO), budgets, TWO, "offload", homes=split_homes(graph))
    assert plan.solver.stats.parked > 0
    check_against_eager("gpt2", plan, trace=True).close()
    check_against_eager("gpt2", plan, trace=False, overlap=None).close()
    check_against_eager("gpt2", plan, trace=False, overlap=True).close()


def test_slow_link_makes_it_recompute_instead_of_parking() -> None:
    """A copy costing five ops: parking is slower than the checkpointing orders it also tries, so the search
    returns a plan as fast as the checkpoint search's at the same budget (cpu:1 can only store)."""
    g = fwd_bwd(12)
    slow = two_cpus(g, op_s=1.0, latency=5.0, bandwidth=1e9)
    slow = Profile(g.fingerprint, slow.devices, {"cpu:0": slow.compute["cpu:0"], "cpu:1": {}}, slow.copy)
    half, homes = eager_peak(g) // 2, {"x": "cpu:0"}
    off = solve(g, slow, {"cpu:0": half, "cpu:1": eager_peak(g)}, TWO, "offload", homes=homes)
    ck = solve(g, slow, {"cpu:0": half}, ("cpu:0",), "checkpoint", homes=homes)
    assert simulate(g, off, slow).makespan_s <= simulate(g, ck, slow).makespan_s
    assert off.solver.stats.parked == 0 and off.solver.stats.recomputes > 0
