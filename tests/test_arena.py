"""Planned addresses (xsched.allocator.addresses, xsched.execute.arena): offsets checked by an independent pairwise
check and against exhaustive search, hand counts, and plans run in the arena on logical CPUs against eager PyTorch
(outputs, gradients), each placed value at its planned address, and the bytes outside the arena counted live."""

from __future__ import annotations

import functools
import itertools
import random

import pytest
import torch
from conftest import chain_graph
from executor_support import eager_plan_on, eager_reference, recompute_plan, workload
from torch.testing import assert_close

from xsched.allocator.addresses import (
    GREEDY_ORDERS,
    Residency,
    aligned,
    best_greedy,
    cpsat_offsets,
    greedy_offsets,
    plan_addresses,
    residencies,
)
from xsched.allocator.placement import ArenaPlan, out_variant
from xsched.capture.torch import bind_inputs, unpack_outputs
from xsched.contracts.plan import Compute, Copy, Free
from xsched.execute.arena import ARENA_KINDS
from xsched.execute.executor import Executor
from xsched.execute.live_bytes import LiveBytes, _named
from xsched.execute.steps import STEP_KINDS
from xsched.solve.reference import eager_plan

pytestmark = pytest.mark.usefixtures("one_thread")


@functools.cache
def plan_of(name: str, devices: tuple[str, ...], percent: int):
    """executor_support's recompute plan, solved once per module."""
    return recompute_plan(name, devices, percent)


def disjoint(rs, offsets, size) -> None:
    """The independent check: residencies of one device live at a common step share no byte."""
    for a, b in itertools.combinations(rs, 2):
        if a.device == b.device and a.start <= b.end and b.start <= a.end:
            lo_a, lo_b = offsets[a.key], offsets[b.key]
            assert lo_a + size[a.key] <= lo_b or lo_b + size[b.key] <= lo_a, (a, b, lo_a, lo_b)


def random_residencies(seed: int, n: int, steps: int = 12, units: int = 4) -> list[Residency]:
    rng = random.Random(seed)
    out = []
    for k in range(n):
        start = rng.randrange(steps)
        out.append(Residency(f"v{k}", "d", start, rng.randrange(start, steps), 512 * rng.randint(1, units)))
    return out


def test_hand_counted_chain() -> None:
    """x -> a0 (1000 B) -> a1 (600) -> a2 (2000), backward g2 (2000), g1 (600), g0 (1000, the output): at b2 a0, a1,
    a2 and g2 are live (1024 + 1024 + 2048 + 2048 aligned); greedy places a2, g2, a0, a1 stacked and g1 at 0."""
    graph = chain_graph([1000, 600, 2000], train=True)
    plan = eager_plan(graph, "cpu")
    a = plan_addresses(graph, plan)
    assert a.lower_bound == {"cpu": 6144} and a.arena_bytes == {"cpu": 6144}
    at = {k[0]: off for k, off in a.offsets.items()}
    assert at == {"a2": 0, "g2": 2048, "a0": 4096, "a1": 5120, "g1": 0}
    assert a.homed == {"cpu": 8} and a.outside_peak == {"cpu": 1000}  # g0 is still resident at the end
    assert a.predicted_peak("cpu") == 8 + 6144 + 1000


@pytest.mark.parametrize("seed", range(6))
def test_greedy_and_cpsat_against_exhaustive_search(seed: int) -> None:
    """On 5 residencies every offset assignment (in 512 B units) is tried: CP-SAT proves the optimum, greedy is at or
    above it, and both pass the pairwise check."""
    rs = random_residencies(seed, 5, steps=6, units=3)
    size = {r.key: r.nbytes for r in rs}
    best = None
    ranges = [range(0, sum(size.values()) // 512 - size[r.key] // 512 + 1) for r in rs]
    for offs in itertools.product(*ranges):
        o = {r.key: 512 * x for r, x in zip(rs, offs)}
        if all(
            o[a.key] + size[a.key] <= o[b.key] or o[b.key] + size[b.key] <= o[a.key]
            for a, b in itertools.combinations(rs, 2)
            if a.overlaps(b)
        ):
            top = max(o[r.key] + size[r.key] for r in rs)
            best = top if best is None else min(best, top)
    for order, tightest in itertools.product(GREEDY_ORDERS, (False, True)):
        placed = greedy_offsets(rs, size, order, tightest)
        disjoint(rs, placed, size)
        assert max(placed[r.key] + size[r.key] for r in rs) >= best
    greedy = best_greedy(rs, size)
    solved, method = cpsat_offsets(rs, size, greedy, 512, 10.0)
    disjoint(rs, solved, size)
    assert method == "optimal" and max(solved[r.key] + size[r.key] for r in rs) == best


@pytest.mark.parametrize("seed", range(4))
def test_random_residencies_never_overlap(seed: int) -> None:
    rs = random_residencies(100 + seed, 60, steps=40, units=16)
    size = {r.key: r.nbytes for r in rs}
    for order, tightest in itertools.product(GREEDY_ORDERS, (False, True)):
        disjoint(rs, greedy_offsets(rs, size, order, tightest), size)


@pytest.mark.parametrize("devices", [("cpu:0",), ("cpu:0", "cpu:1")])
def test_zoo_plan_addresses_pass_the_check_and_the_bound(devices) -> None:
    _, graph = workload("gpt2")
    plan = plan_of("gpt2", devices, 25)
    a = ArenaPlan(graph, plan, time_limit_s=0.5).addresses
    placed = [r for r in residencies(graph, plan) if r.key in a.offsets]
    assert placed and len(placed) == len(a.offsets)
    disjoint(placed, a.offsets, a.sizes)
    for d in plan.devices:
        assert a.arena_bytes[d] >= a.lower_bound[d]
        mine = [r for r in placed if r.device == d]
        # the lower bound recounted: aligned bytes live at each step where a residency begins (the most is at one)
        live = max((sum(a.sizes[q.key] for q in mine if q.start <= r.start <= q.end) for r in mine), default=0)
        assert a.lower_bound[d] == live


def test_out_variants_are_found_from_the_schema() -> None:
    assert out_variant("aten.mm.default")[1] == ("out",)
    assert out_variant("aten.native_layer_norm.default")[1] == ("out0", "out1", "out2")
    assert out_variant("aten.add.Tensor")[0].__name__.endswith("add.out")
    assert out_variant("aten.view.default") is None  # a view: no out=
    assert out_variant("getitem") is None


def checked_table(placed_ok: list) -> dict:
    """The arena's step kinds, each placed value checked after its step: at the arena's base plus its offset."""

    def wrap(kind):
        def make(ex, i, s):
            fn = ARENA_KINDS[kind](ex, i, s)
            d = s.device if kind is Compute else s.dst
            vals = ex.graph.op[s.op].outputs if kind is Compute else (s.value,)
            keys = [(v, d, i) for v in vals if (v, d, i) in ex.arena.planned.addresses.offsets]

            def step(st):
                fn(st)
                for k in keys:
                    t = st.stores[d].tensors[k[0]]
                    at = ex.arena.planned.addresses.offsets[k] + ex.graph.value[k[0]].storage_offset * t.itemsize
                    assert t.data_ptr() == ex.arena.base(d) + at, k
                    placed_ok.append(k)

            return step

        return make

    return {Compute: wrap(Compute), Copy: wrap(Copy)}


@pytest.mark.parametrize(
    "name,devices,percent,mode",
    [
        ("gpt2", ("cpu:0",), 25, True),
        ("gpt2", ("cpu:0",), 25, "whole"),
        ("gpt2", ("cpu:0", "cpu:1"), 25, True),
        ("mlp_mixer", ("cpu:0",), 30, True),
    ],
)
def test_arena_runs_match_eager_at_their_planned_addresses(name, devices, percent, mode) -> None:
    z, graph = workload(name)
    plan = plan_of(name, devices, percent)
    env = bind_inputs(graph, z.model, z.inputs)
    outs, grads, _ = eager_reference(name, seed=7)
    placed: list = []
    ex = Executor(graph, plan, planned_addresses=mode, table=checked_table(placed), overlap=False)
    torch.manual_seed(7)
    run = ex(env)
    got = unpack_outputs(graph, run.outputs)
    for a, b in zip(got.outputs, outs):
        assert_close(a, b.detach(), rtol=1e-5, atol=1e-6)
    for n, g in got.grads.items():
        assert_close(g, grads[n], rtol=1e-5, atol=1e-6, msg=lambda m, n=n: f"grad of {n}: {m}")
    assert set(placed) == set(ex.arena.planned.addresses.offsets)  # every placed value was made where planned
    drawn = [i for i in ex.arena.planned.compute_steps if plan.steps[i].op in ex.random]
    assert not ex.random or any(plan.steps[i].op in ex.recomputed_random for i in drawn)  # replayed draws in the arena
    if len(devices) == 2:
        assert any(isinstance(plan.steps[k[2]], Copy) for k in placed)  # copies write into the arena too
    ex.close()


@pytest.mark.parametrize(
    "name,devices,mode", [("gpt2", ("cpu:0",), True), ("gpt2", ("cpu:0", "cpu:1"), True), ("gpt2", ("cpu:0",), "whole")]
)
def test_bytes_outside_the_arena_are_the_planned_outside_peak(name, devices, mode) -> None:
    """The allocator-level count (LiveBytes) of live storages, the arena buffers and homed inputs set aside, peaks at
    the plan's outside count on each device (within 3%, as the plan's own peaks in test_live_bytes)."""
    z, graph = workload(name)
    plan = plan_of(name, devices, 25)
    env = bind_inputs(graph, z.model, z.inputs)
    count = LiveBytes()
    kinds = {**STEP_KINDS, **ARENA_KINDS}
    where = {Compute: lambda s: s.device, Copy: lambda s: s.dst, Free: lambda s: s.device}
    table = {k: _named(kinds[k], where[k], count) for k in (Compute, Copy, Free)}
    ex = Executor(graph, plan, planned_addresses=mode, table=table, overlap=False)
    st = ex.start(env)
    with count:
        for t in [*ex.arena.buffers.values(), *(t for s in st.stores.values() for t in s.tensors.values())]:
            count.track(t, "-")
        count.reset_peak()
        ex.run(st)
    a = ex.arena.planned.addresses
    # the values alone: workspaces and a composite out='s temporaries are allocated inside their op, unseen here
    values = plan_addresses(graph, plan, lambda r: r.key in a.offsets, search_work=0, to_the_end=True)
    for d in plan.devices:
        got, want = count.peak.get(d, 0), values.outside_peak[d]
        # 8 B: the 0-dim value masked_fill's rewrite makes (placement._rewrites), live during its op only
        assert abs(got - want) <= 0.03 * max(want, got) + 8, (d, want, got)
    ex.close()


def test_eager_plan_in_the_arena_on_one_cpu_matches_eager() -> None:
    """A plan with no recompute: the arena is within 1% of its lower bound (greedy on a stack-like order)."""
    z, graph = workload("gpt2")
    plan = eager_plan_on(graph, ("cpu:0",))
    ex = Executor(graph, plan, planned_addresses=True)
    torch.manual_seed(7)
    got = unpack_outputs(graph, ex(bind_inputs(graph, z.model, z.inputs)).outputs)
    outs, grads, _ = eager_reference("gpt2", seed=7)
    assert_close(got.outputs[0], outs[0].detach(), rtol=1e-5, atol=1e-6)
    for n, g in got.grads.items():
        assert_close(g, grads[n], rtol=1e-5, atol=1e-6)
    a = ex.arena.planned.addresses
    assert a.arena_bytes["cpu:0"] <= 1.01 * a.lower_bound["cpu:0"]
    assert aligned(1) == 512
    ex.close()


@pytest.mark.parametrize("budgets,method", [({"cpu": "50%"}, "auto"), ({"cpu:0": "45%", "cpu:1": "100%"}, "greedy")])
def test_wrap_with_planned_addresses_trains_like_eager(budgets, method) -> None:
    """test_wrap's MLP (dropout, batch norm), 3 SGD steps with momentum: losses, params and running stats equal eager's,
    with the step's values in the arena."""
    import copy

    from test_wrap import assert_same_state, batch, mlp, train

    from xsched.execute.wrap import wrap

    eager = mlp()
    model = copy.deepcopy(eager)
    w = wrap(model, batch()[:1], budgets, method=method, profile="model", time_limit=3, planned_addresses=True)
    ref, got = train(eager, 3), train(w, 3)
    assert w._first.executor.arena is not None and w._first.executor.arena.planned.addresses.offsets
    for a, b in zip(got, ref):
        assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert_same_state(model, eager)


def test_replay_with_an_arena_is_one_block_and_the_outside_values() -> None:
    """chain [4, 2, 8] MiB with its backward, eager on cuda:0, replayed on the caching-allocator model: the arena is one
    22 MiB block (a0, a1, a2 and g2 live at b2), x (8 B) a 2 MiB small segment, g0 (4 MiB, the output) a 20 MiB large
    segment: 44 MiB reserved, against 2 + 22 + 20 + 20 MiB (a2's and g2's own segments) without the arena."""
    from xsched.allocator import replay_reserved

    MiB = 1 << 20
    graph = chain_graph([4 * MiB, 2 * MiB, 8 * MiB], train=True)
    plan = eager_plan(graph, "cuda:0")
    a = plan_addresses(graph, plan)
    assert a.arena_bytes == {"cuda:0": 22 * MiB}
    got = replay_reserved(graph, plan, arena=a)["cuda:0"]
    assert got.reserved == 44 * MiB


def test_cli_run_takes_planned_addresses(tmp_path, capsys) -> None:
    from executor_support import ZOO

    from xsched.cli import main

    _, graph = workload("gpt2")
    eager_plan_on(graph, ("cpu:0",)).save(tmp_path / "plan.json")
    batch, scale = ZOO["gpt2"][:2]
    argv = ["run", "zoo:gpt2", str(tmp_path / "plan.json"), "--iters", "1", "--warmup", "1", "--scale", scale]
    assert main([*argv, "--batch", str(batch), "--planned-addresses"]) == 0
    assert "peak cpu:0" in capsys.readouterr().out


def test_outputs_live_across_the_boundary_are_placed_only_in_whole_step_runs() -> None:
    """x -> a (a graph output) on cpu:0, copied to cpu:1 before the autograd boundary and freed there after it: wrap
    hands the caller `a` at the boundary, so that copy stays outside the arena; a whole-step run places it."""
    from xsched.contracts.graph import Graph, Op, Value
    from xsched.contracts.plan import Plan
    from xsched.contracts.result import SolveResult

    values = (Value("x", 16, "input", (4,), "float32"), Value("a", 16, "activation", (4,), "float32"))
    graph = Graph("cross", values, (Op("f", "aten.relu.default", ("x",), ("a",)),), ("a",))
    steps = (Compute("f", "cpu:0"), Copy("a", "cpu:0", "cpu:1"), Free("a", "cpu:1"))
    plan = Plan(graph.fingerprint, {}, {"x": "cpu:0"}, steps, SolveResult("hand", "heuristic"), boundary=2)
    assert ArenaPlan(graph, plan).copy_steps == set()
    whole = ArenaPlan(graph, plan, handed=False)
    assert whole.copy_steps == {1} and whole.addresses.offsets == {("a", "cpu:1", 1): 0}


def test_arena_on_the_lanes_runs_twice_like_eager() -> None:
    """The offload plan on cpu:0 + cpu:1 on the executor's lanes (a thread per stream: copies beside computes), whole
    steps, two runs through one arena: each matches eager, the second after the first's slots were reused."""
    z, graph = workload("gpt2")
    plan = plan_of("gpt2", ("cpu:0", "cpu:1"), 25)
    env = bind_inputs(graph, z.model, z.inputs)
    outs, grads, _ = eager_reference("gpt2", seed=7)
    ex = Executor(graph, plan, planned_addresses="whole", overlap=True)
    try:
        for _ in range(2):
            torch.manual_seed(7)
            got = unpack_outputs(graph, ex(env).outputs)
            assert_close(got.outputs[0], outs[0].detach(), rtol=1e-5, atol=1e-6)
            for n, g in got.grads.items():
                assert_close(g, grads[n], rtol=1e-5, atol=1e-6, msg=lambda m, n=n: f"grad of {n}: {m}")
    finally:
        ex.close()
