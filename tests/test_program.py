"""Generated inline programs against the executor's step functions, the simulator and eager semantics."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from xsched.capture.torch import bind_inputs, capture
from xsched.contracts.graph import Graph, Op, Value
from xsched.contracts.plan import Compute, Free, Plan
from xsched.contracts.result import SolveResult
from xsched.errors import XschedError
from xsched.execute.executor import Executor
from xsched.execute.program import gather, inline_program
from xsched.pipeline import solve_plan
from xsched.simulate import simulate

pytestmark = pytest.mark.usefixtures("one_thread")


def mlp_graph() -> tuple[Graph, dict[str, torch.Tensor]]:
    """Linear + batch norm + ReLU + dropout blocks: in-place reuse, watched buffer updates, random ops."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(3):
        layers += [nn.Linear(32, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(0.3)]
    model = nn.Sequential(*layers, nn.Linear(32, 4)).train()
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(1))
    graph = capture(copy.deepcopy(model), (x,))
    env = bind_inputs(graph, model, (x,))
    tangents = {v.id: torch.ones(v.shape, dtype=getattr(torch, v.dtype)) for v in graph.values if v.kind == "tangent"}
    return graph, {**env, **tangents}


@pytest.mark.parametrize("budget,method", [("100%", "eager"), ("60%", "auto")])
def test_program_matches_step_functions_and_simulator(budget: str, method: str) -> None:
    """Untraced (generated program) and traced (one step function at a time) runs: the same tensors bit for bit,
    the same bytes resident at the end (the simulator's) and the same peak; recomputed dropout masks replay."""
    graph, env = mlp_graph()
    plan = solve_plan(graph, {"cpu": budget}, method=method, time_limit=3)
    watch = frozenset(r["ref"] for r in graph.buffer_updates.values())
    ex = Executor(graph, plan, watch=watch)
    assert ex.reuse, "the eager and checkpoint plans both run some ReLU in place"
    runs = []
    for trace in (False, True):
        torch.manual_seed(3)
        st = ex.start(env)
        ex.run(st, trace=trace)
        runs.append((st, ex.outputs(st)))
    (fast, got), (slow, want) = runs
    assert got.keys() == want.keys()
    for k in got:
        assert torch.equal(got[k], want[k]), k
    for k in watch:
        assert torch.equal(fast.first[k], slow.first[k]), k
    sim = simulate(graph, plan)
    assert fast.resident() == slow.resident() == sim.resident_after[-1]
    assert fast.peak() == slow.peak()
    assert set(fast.rng.states) == ex.recomputed_random  # the generator state is saved only to be replayed
    if method == "auto":
        assert ex.recomputed_random, "the 60% plan recomputes a dropout"
    ex.close()


def toy(nbytes_b: int = 64) -> tuple[Graph, dict[str, torch.Tensor]]:
    """x -> relu -> a -> mm(a, w) -> b, with b's declared size given."""
    values = (
        Value("x", 64, "input", (4, 4), "float32", name="input:0"),
        Value("w", 48, "param", (3, 4), "float32", name="w"),
        Value("a", 64, "activation", (4, 4), "float32"),
        Value("b", nbytes_b, "activation", (4, 4), "float32"),
    )
    ops = (
        Op("relu", "aten.relu.default", ("x",), ("a",), "fwd", call={"args": [{"ref": "x"}], "outs": [[]]}),
        Op(
            "mm",
            "aten.mm.default",
            ("a", "w"),
            ("b",),
            "fwd",
            call={"args": [{"ref": "a"}, {"ref": "w"}], "outs": [[]]},
        ),
    )
    return Graph("toy", values, ops, ("b",)), {"x": torch.randn(4, 4), "w": torch.randn(3, 4)}


def toy_plan(graph: Graph, steps: tuple) -> Plan:
    return Plan(graph.fingerprint, {}, {"x": "cpu", "w": "cpu"}, steps, SolveResult("hand", "heuristic"))


def test_program_errors_name_step_op_value_and_device() -> None:
    graph, env = toy()
    plan = toy_plan(graph, (Compute("relu", "cpu"), Compute("mm", "cpu"), Free("a", "cpu")))
    ex = Executor(graph, plan)
    with pytest.raises(XschedError, match="aten.mm.default failed") as e:  # w is 3x4: a @ w has no shape
        ex(env)
    assert (e.value.step, e.value.op, e.value.device) == (1, "mm", "cpu")
    ok = {"x": env["x"], "w": torch.randn(4, 4)}
    graph2, _ = toy(nbytes_b=32)
    ex = Executor(graph2, toy_plan(graph2, plan.steps))
    with pytest.raises(XschedError, match="produced 64 bytes for a value of 32") as e:
        ex(ok)
    assert (e.value.step, e.value.op, e.value.value) == (1, "mm", "b")
    broken = toy_plan(graph, (Compute("mm", "cpu"),))  # reads `a` before anything computes it
    ex = Executor(graph, broken, check=False)
    with pytest.raises(XschedError, match="input value is not available") as e:
        ex(ok)
    assert (e.value.step, e.value.value) == (0, "a")
    twice = toy_plan(graph, (Compute("relu", "cpu"), Free("a", "cpu"), Free("a", "cpu"), Compute("relu", "cpu")))
    ex = Executor(graph, twice, check=False)
    with pytest.raises(XschedError, match="not resident") as e:
        ex(ok)
    assert (e.value.step, e.value.value) == (2, "a")


def test_inline_program_only_for_one_device_computes_and_frees() -> None:
    graph, _ = toy()
    plan = toy_plan(graph, (Compute("relu", "cpu"), Compute("mm", "cpu"), Free("a", "cpu")))
    two = Plan(
        graph.fingerprint,
        {},
        {"x": "cpu:0", "w": "cpu:1"},
        (Compute("relu", "cpu:0"), Compute("mm", "cpu:1")),
        SolveResult("hand", "heuristic"),
    )
    with pytest.raises(XschedError, match="one device"):
        inline_program(Executor(graph, two, check=False).prepared, 0, 2)
    assert callable(inline_program(Executor(graph, plan, check=False).prepared, 0, 3))


def test_gather_applies_views_and_keeps_none() -> None:
    t = torch.arange(12.0).reshape(3, 4)
    refs = [{"ref": "a"}, None, {"ref": "a", "view": [["aten.t.default", []], ["aten.expand.default", [[2, 4, 3]]]]}]
    got = gather(refs, [torch.device("cpu")] * 3)({"a": t})
    assert got[0] is t and got[1] is None
    assert torch.equal(got[2], t.t().expand(2, 4, 3)) and got[2].data_ptr() == t.data_ptr()
    with pytest.raises(KeyError):
        gather(refs, [torch.device("cpu")] * 3)({})
