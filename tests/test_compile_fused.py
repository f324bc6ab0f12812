"""Fusion-aware costs: the fusible classification, the fused profile, and the min-cut solver (xsched.solve.heuristics.fused_cut)
against an exhaustive search of saved sets with fused costs on small graphs."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from conftest import BENCH
from torch import nn

from xsched.capture.torch import capture
from xsched.contracts.graph import Graph, Op, Value
from xsched.contracts.plan import Compute
from xsched.contracts.profile import OpCost
from xsched.profiling.fused import fused_profile, fusible_target
from xsched.profiling.model import cost_profile
from xsched.simulate import simulate
from xsched.solve.api import solve
from xsched.solve.heuristics.fused_cut import banned, forward_values, min_cut, needs, save_cost
from xsched.solve.reference import eager_peak

FUSIBLE = ("aten.mul.Tensor", "aten.gelu.default", "aten.add.Tensor", "aten.tanh.default")
HEAVY = ("aten.mm.default", "aten.bmm.default")


def test_fusible_targets() -> None:
    for t in (*FUSIBLE, "aten.native_layer_norm.default", "aten.gelu_backward.default", "aten.div.Scalar"):
        assert fusible_target(t), t
    for t in (*HEAVY, "aten.addmm.default", "aten.bernoulli.p", "aten.embedding.default", "not.a.target"):
        assert not fusible_target(t), t


def random_joint_graph(seed: int) -> Graph:
    """x, a param and a tangent; 4-8 forward ops (fusible or not) reading 1-2 earlier values; 3-5 backward ops each
    reading the previous gradient and 1-2 random forward values."""
    rng = random.Random(seed)
    values = [Value("x", 16, "input"), Value("w", 16, "param"), Value("t", 16, "tangent")]
    ops: list[Op] = []
    fwd = ["x", "w"]
    for i in range(rng.randint(4, 8)):
        ins = tuple(dict.fromkeys(rng.sample(fwd, k=min(len(fwd), rng.randint(1, 2)))))
        v = f"a{i}"
        values.append(Value(v, rng.choice((8, 16, 32, 64))))
        ops.append(Op(f"f{i}", rng.choice(FUSIBLE + HEAVY), ins, (v,), "fwd"))
        fwd.append(v)
    grad = "t"
    for i in range(rng.randint(3, 5)):
        reads = rng.sample(fwd[2:], k=rng.randint(1, 2))
        v = f"g{i}"
        values.append(Value(v, 16))
        ops.append(Op(f"b{i}", rng.choice(FUSIBLE + HEAVY), (grad, *reads), (v,), "bwd"))
        grad = v
    return Graph(f"joint{seed}", tuple(values), tuple(ops), (fwd[-1], grad))


def exhaustive(graph: Graph) -> float:
    """The least fused cost over every set of saved forward values from which backward can recompute what it needs
    through fusible ops only, by enumeration."""
    fwd = forward_values(graph)
    need = needs(graph, fwd)
    candidates = sorted(v for v in fwd if v in graph.producer)
    best = float("inf")
    for k in range(len(candidates) + 1):
        for saved in itertools.combinations(candidates, k):
            have = set(saved)

            def ok(v: str, have: set[str] = have) -> bool:
                if v in have or v not in graph.producer:
                    return True
                return not banned(graph, v) and all(ok(u) for u in graph.op[graph.producer[v]].inputs)

            if all(ok(v) for v in need):
                best = min(best, sum(save_cost(graph, v, fwd) for v in saved))
    return best


@pytest.mark.parametrize("seed", range(40))
def test_min_cut_is_the_exhaustive_optimum(seed: int) -> None:
    graph = random_joint_graph(seed)
    saved, value = min_cut(graph)
    fwd = forward_values(graph)
    assert value == exhaustive(graph)
    assert value == sum(save_cost(graph, v, fwd) for v in saved if v in graph.producer)


def test_a_fusible_chain_is_recomputed_and_a_matmul_saved() -> None:
    """x -mm-> a -gelu-> b -mul-> c -mm-> out; backward reads a, b and c. Saving a alone (16 B, read once) lets
    backward recompute b and c inside its own kernels; b and c would cost 2 x their bytes each (never written by a
    forward that fuses gelu and mul into the second mm)."""
    vals = [Value("x", 16, "input"), Value("w", 16, "param"), Value("t", 16, "tangent")]
    vals += [Value(v, 16) for v in ("a", "b", "c", "out", "g0", "g1")]
    ops = (
        Op("mm0", "aten.mm.default", ("x", "w"), ("a",), "fwd"),
        Op("gelu", "aten.gelu.default", ("a",), ("b",), "fwd"),
        Op("mul", "aten.mul.Tensor", ("b", "b"), ("c",), "fwd"),
        Op("mm1", "aten.mm.default", ("c", "w"), ("out",), "fwd"),
        Op("b0", "aten.mm.default", ("t", "c"), ("g0",), "bwd"),
        Op("b1", "aten.mul.Tensor", ("g0", "b"), ("g1",), "bwd"),
    )
    graph = Graph("chain", tuple(vals), ops, ("out", "g1"))
    saved, value = min_cut(graph)
    assert saved == {"a", "out"} and value == 32  # out is a graph output: materialised, saved at its bytes
    assert value == exhaustive(graph)


def test_fused_profile_prices_fusible_ops_at_zero_and_regions_as_measured() -> None:
    graph = random_joint_graph(3)
    base = cost_profile(graph, ["cpu"])
    heavy = [o.id for o in graph.ops if not fusible_target(o.target)]
    light = [o.id for o in graph.ops if fusible_target(o.target)]
    assert heavy and light
    costs = dict(base.compute["cpu"])
    for k, o in enumerate(heavy):  # hand-set times 1, 2, 3, ... ms
        costs[o] = OpCost((k + 1) * 1e-3, 1.0)
    from dataclasses import replace

    base = replace(base, compute={"cpu": costs})
    fused = fused_profile(graph, base, "cpu", {tuple(graph.op[o].id for o in (*heavy[:2], *light)): 6e-3})
    for o in light:
        assert fused.compute["cpu"][o].time_s == 0.0
    # the region's 6 ms over its two heavy ops in proportion 1:2
    assert fused.compute["cpu"][heavy[0]].time_s == pytest.approx(2e-3)
    assert fused.compute["cpu"][heavy[1]].time_s == pytest.approx(4e-3)
    assert fused.compute["cpu"][heavy[0]].energy_j == pytest.approx(2.0)


def test_fused_cut_plans_a_captured_model_recomputing_only_fusible_ops() -> None:
    """Linear + LayerNorm + GELU x 3: priced as compiled (fusible ops free), the min-cut plan recomputes layer norms
    and GELUs only, costs no more time than the eager plan, and needs less memory; the runner keeps it."""
    torch.manual_seed(0)
    m = nn.Sequential(*[mod for _ in range(3) for mod in (nn.Linear(32, 32), nn.LayerNorm(32), nn.GELU())])
    graph = capture(m, (torch.randn(64, 32),))
    profile = fused_profile(graph, cost_profile(graph, ["cpu"]), "cpu")
    eager = solve(graph, profile, {"cpu": "100%"}, method="eager")
    plan = solve(graph, profile, {"cpu": int(eager_peak(graph) * 0.9)}, method="fused-cut")
    assert plan.solver.method == "fused-cut" and plan.solver.stats.variant == "fusible recompute"
    counts: dict[str, int] = {}
    for s in plan.steps:
        if isinstance(s, Compute):
            counts[s.op] = counts.get(s.op, 0) + 1
    recomputed = [o for o, n in counts.items() if n > 1]
    assert recomputed and all(fusible_target(graph.op[o].target) for o in recomputed)
    sim = simulate(graph, plan, profile)
    assert sim.time_s == pytest.approx(simulate(graph, eager, profile).time_s)
    assert sim.peak_bytes["cpu"] < 0.9 * eager_peak(graph)


def test_region_times_name_each_compiled_region_by_its_ops() -> None:
    """Regions "compiled" by running their fx graph as it is (no inductor: fast), timed through their profiler
    labels: one time per region, keyed by the ops it computes, in plan order."""
    from xsched.capture.torch import bind_inputs
    from xsched.execute.executor import Executor
    from xsched.profiling.fused import region_times
    from xsched.solve.reference import eager_plan

    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8), nn.Tanh())
    x = torch.randn(4, 8)
    graph = capture(m, (x,))
    env = bind_inputs(graph, m, (x,))
    env.update({v: torch.ones(graph.value[v].shape) for v in graph.inputs if graph.value[v].kind == "tangent"})
    plan = eager_plan(graph, "cpu")
    ex = Executor(graph, plan, compile=True)

    def as_is(gm: torch.fx.GraphModule, inputs: list) -> object:
        def run(args: list) -> object:
            out = gm(*args)
            args.clear()
            return out

        return run

    ex.segments.compile_fn = as_is
    times = region_times(ex, env, runs=2)
    assert list(times) == [tuple(s.op for s in plan.steps if isinstance(s, Compute))]
    assert all(t > 0 for t in times.values())


def test_fused_cut_waits_for_torch_only_where_it_needs_it_and_the_time_covers_it(monkeypatch) -> None:
    """Telling a captured graph's fusible ops apart needs torch's tags; an imported graph's names need nothing.
    Without torch loaded and less time left than its import, fused-cut is not started (the runner records why)."""
    import sys

    from xsched.importers import import_networkx
    from xsched.profiling.fused import needs_torch
    from xsched.solve import registry
    from xsched.solve.options import SolverOptions, deadline
    from xsched.solve.problem import Problem

    captured = capture(nn.Sequential(nn.Linear(8, 8), nn.GELU()), (torch.randn(4, 8),))
    bench_graph, bench_profile = import_networkx(BENCH / "random_layered_n100.json")
    assert needs_torch(captured) and not needs_torch(bench_graph)
    monkeypatch.delitem(sys.modules, "torch")  # as in a process that has not loaded it (restored after)
    entry = registry.SOLVERS["fused-cut"]
    p = Problem.make(captured, cost_profile(captured, ["cpu"]), {"cpu": "90%"})
    with deadline(registry.IMPORT_S["torch"] / 2):
        r = registry.run_member(entry, p, SolverOptions(time_limit_s=1.0), None)
    assert r.status == "no_incumbent" and "importing torch" in r.message
    q = Problem.make(bench_graph, bench_profile, {"bench": "90%"})
    with deadline(registry.IMPORT_S["torch"] / 2):  # no torch needed: it runs
        assert "importing torch" not in registry.run_member(entry, q, SolverOptions(time_limit_s=1.0), None).message
