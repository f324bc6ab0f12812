"""Planned addresses and what runs outside the arena (issue 31): an op's workspace counted once, outside the arena,
during its step (hand counts); `out=` overloads that are PyTorch's generated composites (functional, then a copy)
found from the dispatch table and either rewritten to write the slot (bit for bit the functional op, no temporary)
or run outside the arena; GPT-2 on cpu:0 in the arena equal to the default executor, with no more copies than it
makes without in-place reuse."""

from __future__ import annotations

import pytest
import torch
from executor_support import eager_plan_on, workload

from xsched.allocator import replay_reserved
from xsched.allocator.placement import ArenaPlan, _rewrites, arena_kernel, composite_out, out_variant
from xsched.capture.torch import bind_inputs, unpack_outputs
from xsched.contracts.graph import Graph, Op, Value
from xsched.contracts.plan import Compute
from xsched.execute.executor import Executor
from xsched.solve.reference import eager_plan

pytestmark = pytest.mark.usefixtures("one_thread")


def _op(name: str, target: str, args: list, out: str, workspace: int = 0) -> Op:
    refs = tuple(a["ref"] for a in args if isinstance(a, dict))
    call = {"args": args, "kwargs": {}, "outs": [[]]}
    return Op(name, target, refs, (out,), "fwd", workspace_bytes=workspace, call=call)


def scratch_graph(workspace: int) -> Graph:
    """x (16 B) -> exp -> a (2048 B) -> softmax (`workspace` bytes of scratch) -> b (2048 B) -> neg -> c (2048 B)."""
    values = (
        Value("x", 16, "input", (4,), "float32"),
        Value("a", 2048, "activation", (512,), "float32"),
        Value("b", 2048, "activation", (512,), "float32"),
        Value("c", 2048, "activation", (512,), "float32"),
    )
    ops = (
        _op("exp", "aten.exp.default", [{"ref": "x"}], "a"),
        _op("softmax", "aten._softmax.default", [{"ref": "a"}, -1, False], "b", workspace),
        _op("neg", "aten.neg.default", [{"ref": "b"}], "c"),
    )
    return Graph("scratch", values, ops, ("c",))


def test_a_workspace_is_outside_the_arena_once() -> None:
    """Hand count, whole steps: a and b live together at softmax, b and c at neg: the arena is 4096 B, the planned
    values' extent, with or without softmax's 10,000 B of scratch; the scratch is the most outside at once (10,000 at
    softmax's step, nothing else outside), so the predicted peak is 16 + 4096 + 10,000; the allocator model, which
    allocates the workspace beside the arena as the op does, peaks at the same blocks."""
    for ws in (0, 10_000):
        graph = scratch_graph(ws)
        plan = eager_plan(graph, "cuda:0")
        arena = ArenaPlan(graph, plan, handed=False)
        a = arena.addresses
        placed = {k[0] for k in a.offsets}
        assert placed == {"a", "b", "c"} and a.arena_bytes == {"cuda:0": 4096} and a.lower_bound == a.arena_bytes
        assert a.outside_peak == {"cuda:0": ws} and a.predicted_peak("cuda:0") == 16 + 4096 + ws
        got = replay_reserved(graph, plan, arena=a)["cuda:0"]
        # counted once (not in the arena and again beside it); the model rounds x and the scratch to 512 B blocks
        assert got.allocated == 512 + 4096 + -(-ws // 512) * 512


def test_a_profiled_workspace_counts_like_the_graphs() -> None:
    """The profile's workspace (measured per device) is the one counted when it is larger than the graph's."""
    from xsched.contracts.profile import DeviceInfo, OpCost, Profile

    graph = scratch_graph(0)
    plan = eager_plan(graph, "cuda:0")
    costs = {"cuda:0": {o.id: OpCost(1e-3, 0.0, 6000 if o.id == "softmax" else 0) for o in graph.ops}}
    profile = Profile(graph.fingerprint, {"cuda:0": DeviceInfo("cuda:0", "cuda", 1 << 30)}, costs, {})
    a = ArenaPlan(graph, plan, handed=False, profile=profile).addresses
    assert a.outside_peak == {"cuda:0": 6000} and a.arena_bytes == {"cuda:0": 4096}


def test_composite_outs_are_found_from_the_dispatch_table() -> None:
    for target in ("aten.native_dropout.default", "aten.native_layer_norm.default", "aten.clone.default"):
        assert composite_out(target), target
    for target in ("aten.mm.default", "aten.add.Tensor", "aten._softmax_backward_data.default", "aten.bernoulli.p"):
        assert not composite_out(target), target
    assert arena_kernel("aten.mm.default") == out_variant("aten.mm.default")
    assert arena_kernel("aten.native_layer_norm.default") is None  # a composite we cannot rewrite: outside
    assert arena_kernel("aten.native_dropout.default") is None
    assert arena_kernel("aten.clone.default")[1] == ("out",)


def _allocated(fn) -> int:
    """Bytes of the tensors allocated while fn runs (the profiler's aten::empty* events)."""
    acts = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=acts, profile_memory=True) as prof:
        fn()
    return sum(max(e.cpu_memory_usage, 0) for e in prof.events() if e.name.startswith("aten::empty"))


REWRITE_CASES = {
    "aten.clone.default": lambda x, m: (x,),
    "aten.copy.default": lambda x, m: (x, x.flip(0)),
    "aten.relu.default": lambda x, m: (x,),
    "aten.masked_fill.Scalar": lambda x, m: (x, m, float("-inf")),
    "aten.masked_fill.Tensor": lambda x, m: (x, m, torch.tensor(-3.5)),
    "aten.native_dropout_backward.default": lambda x, m: (x, m, 1 / 0.9),
    "aten.div.Scalar": lambda x, m: (x, 0.9),
    "aten.mul.Scalar": lambda x, m: (x, 1 / 3),
    "aten.add.Scalar": lambda x, m: (x, 0.7, 3),
    "aten.sub.Scalar": lambda x, m: (x, 0.7, 2),
}


@pytest.mark.parametrize("target", sorted(_rewrites()))
def test_rewrites_write_the_slot_as_the_functional_op(target: str) -> None:
    """Each rewrite, on a slot, equals the functional op bit for bit and allocates at least the output's bytes less
    than the composite `out=` it replaces (its temporary; on the CPU both may still cast a bool mask to float, which
    CUDA's kernels do on the fly)."""
    from xsched.contracts.torch_ops import resolve

    g = torch.Generator().manual_seed(3)
    x, m = torch.randn(64, 33, generator=g), torch.rand(64, 33, generator=g) > 0.5
    args = REWRITE_CASES[target](x, m)
    want = resolve(target)(*args)
    fn, names = arena_kernel(target)
    composite, _ = out_variant(target)
    slot = torch.empty_like(want)
    mine = _allocated(lambda: fn(*args, **{names[0]: slot}))
    assert torch.equal(slot, want)
    theirs = _allocated(lambda: composite(*args, **{names[0]: torch.empty_like(want)}))
    assert theirs - mine >= want.nbytes, (mine, theirs)


def _copies(ex: Executor, env) -> int:
    st = ex.start(env)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        ex.run(st)
    return sum(e.name == "aten::copy_" for e in prof.events())


def test_gpt2_in_the_arena_equals_the_default_executor_with_no_extra_copies() -> None:
    """GPT-2 (dropout on) eagerly on cpu:0, whole steps: the arena's outputs and gradients equal the default
    executor's bit for bit (same seed; the rewrites are exact), no placed compute goes through a composite `out=`
    without a rewrite unless ArenaPlan chose to place them, and a step makes no more aten::copy_ than the default
    executor (in-place reuse on; the arena turns it off, and masked_fill's rewrite is one pass as its in-place form):
    none to bring a functional result into a slot (before, 155 more here)."""
    z, graph = workload("gpt2")
    plan = eager_plan_on(graph, ("cpu:0",))
    env = bind_inputs(graph, z.model, z.inputs)
    arena = Executor(graph, plan, planned_addresses="whole", overlap=False)
    plain = Executor(graph, plan, overlap=False)
    try:
        placed = [plan.steps[i] for i in arena.arena.planned.compute_steps]
        targets = {graph.op[s.op].target for s in placed if isinstance(s, Compute)}
        assert {"aten.clone.default", "aten.masked_fill.Scalar", "aten.div.Scalar"} <= targets
        runs = []
        for ex in (arena, plain):
            torch.manual_seed(7)
            runs.append(unpack_outputs(graph, ex(env).outputs))
        for a, b in zip(runs[0].outputs, runs[1].outputs):
            assert torch.equal(a, b)
        for n, g in runs[0].grads.items():
            assert torch.equal(g, runs[1].grads[n]), n
        torch.manual_seed(7)
        want = _copies(plain, env)
        torch.manual_seed(7)
        assert _copies(arena, env) <= want
        assert arena.arena.planned.composites or all(not composite_out(t) or t in _rewrites() for t in targets)
    finally:
        arena.close()
        plain.close()


def two_lookups() -> Graph:
    """e1, e2 = embedding(w, i1), embedding(w, i2) (4096 B each, a composite out=), s = e1 + e2 (4096 B), then
    b = s + z (16,384 B, broadcast over z's 4 rows), the output; e1 and e2 freed before b is made."""
    row = (1, 1024)
    values = (
        Value("w", 16 * 4096, "input", (16, 1024), "float32"),
        Value("i1", 8, "input", (1,), "int64"),
        Value("i2", 8, "input", (1,), "int64"),
        Value("z", 16384, "input", (4, 1024), "float32"),
        Value("e1", 4096, "activation", row, "float32"),
        Value("e2", 4096, "activation", row, "float32"),
        Value("s", 4096, "activation", row, "float32"),
        Value("b", 16384, "activation", (4, 1024), "float32"),
    )

    def two(name: str, target: str, x: str, y: str, out: str) -> Op:
        return Op(name, target, (x, y), (out,), "fwd", call={"args": [{"ref": x}, {"ref": y}], "outs": [[]]})

    ops = (
        two("emb1", "aten.embedding.default", "w", "i1", "e1"),
        two("emb2", "aten.embedding.default", "w", "i2", "e2"),
        two("sum", "aten.add.Tensor", "e1", "e2", "s"),
        two("wide", "aten.add.Tensor", "s", "z", "b"),
    )
    return Graph("lookups", values, ops, ("b",))


def test_composites_are_placed_where_that_lowers_the_peak() -> None:
    """Hand count, whole steps. Outside: e1 and e2 (8192 B at once) beside an arena of s and b (20,480 B): 28,672 B.
    Placed: e1 and e2 in slots b takes later (b at 0, s at 16,384, e1 at 0, e2 at 4096: 20,480 B), one lookup's
    4096 B temporary beside it at a time: 24,576 B, so ArenaPlan places them; the allocator model allocates that
    temporary with the op. Run on cpu:0, the output equals eager's."""
    graph = two_lookups()
    plan = eager_plan(graph, "cpu:0")
    ap = ArenaPlan(graph, plan, handed=False)
    a = ap.addresses
    assert ap.composites and {k[0] for k in a.offsets} == {"e1", "e2", "s", "b"}
    assert a.arena_bytes == {"cpu:0": 20480} and a.outside_peak == {"cpu:0": 4096}
    assert sorted(a.temporary.values()) == [4096, 4096]
    on_gpu = eager_plan(graph, "cuda:0")
    modelled = replay_reserved(graph, on_gpu, arena=ArenaPlan(graph, on_gpu, handed=False).addresses)["cuda:0"]
    homed = 16 * 4096 + 512 + 512 + 16384  # w, i1, i2, z in 512 B blocks
    assert modelled.allocated == homed + 20480 + 4096
    g = torch.Generator().manual_seed(5)
    env = {"w": torch.randn(16, 1024, generator=g), "i1": torch.tensor([3]), "i2": torch.tensor([11])}
    env["z"] = torch.randn(4, 1024, generator=g)
    ex = Executor(graph, plan, planned_addresses="whole", overlap=False)
    try:
        got = ex(env).outputs["b"]
        want = torch.nn.functional.embedding(env["i1"], env["w"]) + torch.nn.functional.embedding(env["i2"], env["w"])
        assert torch.equal(got, want + env["z"])
        (key,) = [k for k in a.offsets if k[0] == "b"]
        assert got.data_ptr() == ex.arena.base("cpu:0") + a.offsets[key]
    finally:
        ex.close()
