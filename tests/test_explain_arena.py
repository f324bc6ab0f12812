"""Planned addresses in `--explain`, its `--json` and the report: the arena's size counted by hand on a small plan, and
equal to the buffer the executor allocates for the same plan."""

from __future__ import annotations

import json

import pytest
from test_milp import profile_for

from xsched.budgets import format_bytes
from xsched.contracts.graph import Graph, Op, Value
from xsched.contracts.plan import Compute, Free, Plan
from xsched.contracts.result import SolveResult
from xsched.explain import expected_reserved, reserved_text
from xsched.report.data import sweep_cells
from xsched.report.sweep import Point, reserved_fields

GPU = "cuda:0"
N = 1_000_000  # elements: 4,000,000 B in float32, 4,000,256 B aligned to 512
SLOT = 4_000_256
MiB = 1 << 20


def _op(i: str, target: str, x: str, y: str, **kwargs) -> Op:
    call = {"args": [{"ref": x}], "kwargs": kwargs, "outs": [[]]}
    return Op(i, target, (x,), (y,), "fwd", call=call)


def hand_graph() -> Graph:
    """x -> relu -> a -> sigmoid -> b -> tanh -> c -> _to_copy (fp16) -> d, the output. _to_copy has no `out=`
    overload, so d runs outside the arena."""
    values = (
        Value("x", 4 * N, "input", (N,), "float32"),
        *(Value(v, 4 * N, "activation", (N,), "float32") for v in "abc"),
        Value("d", 2 * N, "activation", (N,), "float16"),
    )
    ops = (
        _op("fa", "aten.relu.default", "x", "a"),
        _op("fb", "aten.sigmoid.default", "a", "b"),
        _op("fc", "aten.tanh.default", "b", "c"),
        _op("fd", "aten._to_copy.default", "c", "d", dtype="float16"),
    )
    return Graph("hand", values, ops, ("d",))


def hand_plan(graph: Graph) -> Plan:
    """a and b live together (steps 0-2), c (step 3 on) takes a's freed slot, d (step 5) outside the arena."""
    steps = (
        Compute("fa", GPU),
        Compute("fb", GPU),
        Free("a", GPU),
        Compute("fc", GPU),
        Free("b", GPU),
        Compute("fd", GPU),
        Free("c", GPU),
    )
    return Plan(graph.fingerprint, {}, {"x": GPU}, steps, SolveResult("hand", "heuristic"))


# Hand count. The arena: a, b and c each one 4,000,256 B slot, a and b side by side, c in a's: 8,000,512 B. The
# caching allocator: x's block (4,000,256 B) in a 20 MiB segment (large requests under 10 MiB), the arena's block
# split from that segment, d's 2,000,384 B block too: 20 MiB reserved; d is all that is allocated outside the arena.
# The plan's peak: x, a and b at step 1, 12,000,000 B; 20 MiB over it is +74.8%.
ARENA, OUTSIDE, RESERVED, PEAK = 2 * SLOT, 2_000_384, 20 * MiB, 12_000_000


def test_explain_counts_the_arena_by_hand() -> None:
    graph = hand_graph()
    plan = hand_plan(graph)
    (e,) = expected_reserved(graph, plan).values()
    assert e.arena_bytes == ARENA and e.outside == OUTSIDE
    low, high = e.planned
    assert low == high and high.reserved == RESERVED and high.plan_peak == PEAK
    assert high.allocated == 4_000_256 + ARENA + OUTSIDE  # x, the arena, d
    data = json.loads(json.dumps(e.as_dict()))  # what `xsched plan --explain --json` carries
    assert data["arena_bytes"] == ARENA and data["outside_arena"] == OUTSIDE
    assert data["planned_addresses"][1]["reserved"] == RESERVED
    text = reserved_text(graph, plan)
    want = f"with planned addresses (--planned-addresses) ~20.00 MiB, +74.8% (arena {format_bytes(ARENA)}, at most "
    assert want + f"{format_bytes(OUTSIDE)} outside it)" in text


def test_cli_plan_explain_shows_the_arena(tmp_path, capsys) -> None:
    """`xsched plan --method eager --explain` on the hand graph: eager's order is the hand plan's, so its text and
    `--json` carry the hand-counted arena."""
    from xsched.cli import main
    from xsched.solve.reference import eager_plan

    graph = hand_graph()
    assert hand_plan(graph).steps == eager_plan(graph, GPU).steps
    g, p, out = tmp_path / "g.json", tmp_path / "p.json", tmp_path / "plan.json"
    graph.save(g)
    profile_for(graph, {GPU: {o.id: 1e-3 for o in graph.ops}}, {}).save(p)
    args = ["plan", str(g), str(p), "--method", "eager", "--explain", "-o", str(out)]
    assert main([*args, "--json"]) == 0
    got = json.loads(capsys.readouterr().out)["reserved_expected"][GPU]
    assert got["arena_bytes"] == ARENA and got["planned_addresses"][0]["reserved"] == RESERVED
    assert main(args) == 0
    assert f"(arena {format_bytes(ARENA)}, at most {format_bytes(OUTSIDE)} outside it)" in capsys.readouterr().out


def test_the_sweep_table_has_one_column_per_setting() -> None:
    graph = hand_graph()
    fields = reserved_fields(graph, hand_plan(graph), None)
    assert fields["arena_bytes"] == {GPU: ARENA} and fields["planned_bytes"] == {GPU: (RESERVED, RESERVED)}
    point = Point("m", GPU, 1, "auto", "optimal", 1.0, peak_bytes={GPU: PEAK}, **fields)
    (row,) = sweep_cells([point], ["auto"], [GPU, "cpu"], [GPU])
    # peak (with the default settings' reserved), the host's peak, expandable segments, planned addresses
    assert row[-4:] == ("11.4 MiB (reserved ~20 MiB)", "0 B", "20 MiB", "20 MiB (arena 7.63 MiB)")


@pytest.mark.usefixtures("one_thread")
def test_the_executor_allocates_the_arena_explain_reports() -> None:
    """GPT-2 (the zoo's small one) under a recompute plan on the logical CPU cpu:0, whole steps: the executor's
    buffer is the arena explain reports for the plan (cpu:0 modelled as an accelerator), and the run matches eager."""
    import torch
    from executor_support import eager_reference, recompute_plan, workload
    from torch.testing import assert_close

    from xsched.capture.torch import bind_inputs, unpack_outputs
    from xsched.execute.executor import Executor

    z, graph = workload("gpt2")
    plan = recompute_plan("gpt2", ("cpu:0",), 40)
    expected = expected_reserved(graph, plan, devices=["cpu:0"])["cpu:0"]
    ex = Executor(graph, plan, planned_addresses="whole")
    try:
        assert ex.arena.buffers["cpu:0"].numel() == expected.arena_bytes > 0
        torch.manual_seed(7)
        got = unpack_outputs(graph, ex(bind_inputs(graph, z.model, z.inputs)).outputs)
    finally:
        ex.close()
    outs, _, _ = eager_reference("gpt2", seed=7)
    assert_close(got.outputs[0], outs[0].detach(), rtol=1e-5, atol=1e-6)
