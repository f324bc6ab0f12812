"""H-Partition: every group convex on random DAGs, every block of a training graph convex (forward and backward
parts), backward parts in reverse order of forward parts, and identical transformer layers in one class."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from oracle import assert_prediction_matches
from test_heuristics import train_dags

from xsched.capture.torch import capture
from xsched.contracts.graph import Graph
from xsched.profiling.model import cost_profile
from xsched.simulate import simulate
from xsched.solve.hier import HierSettings, leaf, solve_hier
from xsched.solve.hier.canon import canon
from xsched.solve.hier.hierarchy import build_hierarchy
from xsched.solve.hier.partition import Dag, group_level, is_convex
from xsched.solve.hier.region import make_region, plain, region_homes
from xsched.solve.options import SolverOptions
from xsched.solve.problem import Problem
from xsched.solve.reference import eager_peak
from xsched.zoo import build


def op_dag(g: Graph) -> tuple[Dag, dict[str, int]]:
    idx = g.op_index
    edges = [(idx[g.producer[v]], idx[o.id]) for o in g.ops for v in o.inputs if v in g.producer]
    return Dag.of(len(g.ops), edges), idx


@st.composite
def dags(draw, max_n: int = 40) -> Dag:
    n = draw(st.integers(2, max_n))
    edges = [(a, b) for b in range(n) for a in range(b) if draw(st.integers(0, 99)) < 12]
    return Dag.of(n, edges)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(dags(), st.integers(2, 10), st.integers(1, 8), st.data())
def test_every_group_is_convex(dag: Dag, max_size: int, target: int, data) -> None:
    weights = [data.draw(st.integers(1, 50)) for _ in range(dag.n)]
    groups = group_level(dag, lambda c: float(sum(weights[u] for u in c)), max_size, target)
    assert sorted(u for g in groups for u in g) == list(range(dag.n))  # a partition
    for g in groups:
        assert is_convex(dag, g), sorted(g)
        assert len(g) == 1 or len(g) <= max_size


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(train_dags(max_ops=10), st.integers(1, 4), st.integers(2, 4), st.integers(1, 4))
def test_every_block_of_a_training_graph_is_convex(g: Graph, leaf: int, group: int, top: int) -> None:
    h = build_hierarchy(g, max_leaf=leaf, max_group=group, max_top=top)
    dag, idx = op_dag(g)
    assert sorted(h.top.ops, key=idx.__getitem__) == [o.id for o in g.ops]
    for b in h.blocks:
        for part in (b.f_ops, b.b_ops):
            assert is_convex(dag, frozenset(idx[o] for o in part))
        assert b.leaf or [o for c in b.children for o in c.f_ops] == list(b.f_ops)
    if h.layered:  # the stage order runs forward parts in order, then backward parts in reverse: topological
        order = [o for c in h.top.children for o in c.f_ops] + [o for c in reversed(h.top.children) for o in c.b_ops]
        pos = {o: i for i, o in enumerate(order)}
        assert all(pos[g.producer[v]] < pos[o.id] for o in g.ops for v in o.inputs if v in g.producer)


def layer_classes(n_layer: int) -> tuple[Graph, dict[str, tuple[str, ...]]]:
    """For each transformer layer, the class keys of the bottom blocks inside it, in order."""
    z = build("gpt2", scale=f"tiny:n_layer={n_layer}")
    g = capture(z.model, z.inputs)
    prof = cost_profile(g, ["cpu"])
    homes = {v: "cpu" for v in g.inputs}
    layer_of = {o.id: o.name.split(".")[1] for o in g.ops if o.name.startswith("h.")}
    per_layer: dict[str, list[str]] = {}
    for b in build_hierarchy(g).blocks:
        layers = {layer_of.get(o) for o in b.f_ops} - {None}
        if b.leaf and len(layers) == 1 and all(o in layer_of for o in b.f_ops):
            r = make_region(g, b.f_ops, b.b_ops)
            key = canon(r, prof, ["cpu"], {v: homes[v] for v in r.inputs if v in homes}).key
            per_layer.setdefault(layers.pop(), []).append(key)
    return g, {k: tuple(v) for k, v in per_layer.items()}


def test_a_twelve_layer_gpt_has_one_layer_class_solved_once() -> None:
    """Layers 1..10 of a 12-layer GPT are made of the same classes of blocks as the middle layers of a 4-layer one;
    solving it solves each class once."""
    g, per_layer = layer_classes(12)
    inner = {per_layer[str(i)] for i in range(1, 11)}
    assert len(inner) == 1
    _, shallow = layer_classes(4)
    assert {shallow["1"], shallow["2"]} == inner
    prof = cost_profile(g, ["cpu"])
    plan = solve_hier(
        Problem(g, prof, {"cpu": eager_peak(g)}, ["cpu"], {v: "cpu" for v in g.inputs}),
        SolverOptions(time_limit_s=20, hier_processes=1),
        settings=HierSettings(leaf_s=0, region_s=2, refine=False),
    )
    x = plan.solver.stats
    assert x.solved == x.classes < x.blocks - 20  # 24 layer blocks, two classes among them
    simulate(g, plan, prof)


@pytest.mark.parametrize("name", ["resnet18", "unet"])
def test_zoo_blocks_are_convex(name: str) -> None:
    z = build(name, scale="tiny")
    g = capture(z.model, z.inputs)
    h = build_hierarchy(g)
    dag, idx = op_dag(g)
    assert h.layered and len(h.top.children) <= 16
    for b in h.blocks:
        for part in (b.f_ops, b.b_ops):
            assert is_convex(dag, frozenset(idx[o] for o in part))


def test_budget_driven_leaf_plans_beat_checkpointing_between_its_peaks() -> None:
    """Gap rematerialization and eviction at budgets between checkpointing's leanest and fastest peaks add valid
    plans to a GPT's bottom blocks: at some budget a block then has a plan faster than every keep set that fits."""
    z = build("gpt2", scale="tiny:n_layer=2")
    g = capture(z.model, z.inputs)
    prof = cost_profile(g, ["cpu"])
    homes = {v: "cpu" for v in g.inputs}
    gains = 0
    for b in build_hierarchy(g).blocks:
        if not (b.leaf and b.b_ops):
            continue
        r = plain(make_region(g, b.f_ops, b.b_ops))
        sub_prof = replace(prof, graph=r.graph.fingerprint)
        sub_homes = region_homes(r, homes, "cpu")
        keeps = leaf.heuristic_plans(r, sub_prof, "cpu", sub_homes, ())
        every = leaf.heuristic_plans(r, sub_prof, "cpu", sub_homes)
        assert len(every) >= len(keeps)
        for p in every:
            assert_prediction_matches(r.graph, p, sub_prof, {})  # an independent count of its time and peaks
        for p in every[len(keeps) :]:
            peak = p.predicted.peak_bytes["cpu"]
            fit = [q.predicted.time_s for q in keeps if q.predicted.peak_bytes["cpu"] <= peak]
            gains += not fit or p.predicted.time_s < min(fit) - 1e-12
    assert gains > 0


def test_the_menu_is_smaller_for_many_blocks() -> None:
    """Up to MANY_BLOCKS blocks: 12 options per block and budget-driven leaf plans; above: 6 and keep sets only (a
    96-layer GPT's top H-ILP did not finish in 600 s with the larger menu); settings override both."""
    from xsched.solve.hier import solver

    many = solver.MANY_BLOCKS
    assert HierSettings().menu(many) == (solver.OPTIONS_PER_BLOCK, leaf.DRIVEN_FRACTIONS)
    assert HierSettings().menu(many + 1) == (solver.OPTIONS_MANY_BLOCKS, ())
    assert HierSettings(options=3, driven=True).menu(many + 1) == (3, leaf.DRIVEN_FRACTIONS)
    assert HierSettings(driven=False).menu(1) == (solver.OPTIONS_PER_BLOCK, ())
