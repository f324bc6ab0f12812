"""The executor's rules on hand-made plans: a free waits for the copies out of its value, in-place reuse only of
values nothing else reads, failures and bad inputs as one clear error, lanes that overlap, random draws in plan
order."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from torch.testing import assert_close

from xsched.contracts.graph import Graph, Op, Value
from xsched.contracts.plan import Compute, Copy, Free, Plan, autograd_boundary
from xsched.contracts.result import SolveResult
from xsched.errors import PlanError, XschedError
from xsched.execute.executor import Executor
from xsched.execute.steps import STEP_KINDS

pytestmark = pytest.mark.usefixtures("one_thread")


# ---- dependencies and free safety ----
def _pair_graph() -> tuple[Graph, dict[str, torch.Tensor]]:
    """x -> relu -> a -> neg -> b; `a` is copied to cpu:1 and freed on cpu:0 right after the copy."""
    n = 4096
    values = (
        Value("x", n * 4, "input", (n,), "float32", name="input:0"),
        Value("a", n * 4, "activation", (n,), "float32"),
        Value("b", n * 4, "activation", (n,), "float32"),
    )
    call = {"args": [{"ref": "x"}], "outs": [[]]}
    ops = (
        Op("relu", "aten.relu.default", ("x",), ("a",), "fwd", call=call),
        Op("neg", "aten.neg.default", ("a",), ("b",), "fwd", call={"args": [{"ref": "a"}], "outs": [[]]}),
    )
    return Graph("pair", values, ops, ("b",)), {"x": torch.randn(n)}


def _pair_plan(graph: Graph) -> Plan:
    steps = (Compute("relu", "cpu:0"), Copy("a", "cpu:0", "cpu:1"), Free("a", "cpu:0"), Compute("neg", "cpu:1"))
    steps += (Free("a", "cpu:1"),)
    return Plan(
        graph.fingerprint,
        {},
        {"x": "cpu:0"},
        steps,
        SolveResult("hand", "heuristic"),
        boundary=autograd_boundary(graph, steps),
    )


def test_free_after_copy_waits_for_the_copy() -> None:
    """A slow copy out of `a` and the free of `a` adjacent in the plan: the free must wait for the copy."""
    graph, env = _pair_graph()
    plan = _pair_plan(graph)
    events: list[str] = []
    lock = threading.Lock()

    def slow_copy(ex, i, s):
        inner = STEP_KINDS[Copy](ex, i, s)

        def run(st):
            time.sleep(0.2)
            inner(st)
            with lock:
                events.append("copy")

        return run

    def logged_free(ex, i, s):
        inner = STEP_KINDS[Free](ex, i, s)

        def run(st):
            with lock:
                events.append("free" if "a" in st.stores[s.device].tensors else "free-missing")
            inner(st)

        return run

    ex = Executor(graph, plan, table={Copy: slow_copy, Free: logged_free}, overlap=True)
    assert 1 in ex.deps[2]  # the free waits for the copy out of cpu:0
    out = ex(env).outputs["b"]
    assert events.index("copy") < events.index("free")
    assert_close(out, -torch.relu(env["x"]))
    ex.close()


def test_inplace_reuse_only_for_values_nothing_else_reads() -> None:
    """relu may overwrite `a` only when the plan frees `a` right after it and no copy reads it."""
    n = 64
    values = tuple(Value(v, n * 4, "activation", (n,), "float32") for v in ("a", "b"))
    values = (Value("x", n * 4, "input", (n,), "float32", name="input:0"), *values)
    ops = (
        Op("neg", "aten.neg.default", ("x",), ("a",), "fwd", call={"args": [{"ref": "x"}], "outs": [[]]}),
        Op("relu", "aten.relu.default", ("a",), ("b",), "fwd", call={"args": [{"ref": "a"}], "outs": [[]]}),
    )
    graph = Graph("reuse", values, ops, ("b",))
    x = torch.randn(n)

    def plan(*steps: Compute | Copy | Free) -> Plan:
        return Plan(graph.fingerprint, {}, {"x": "cpu:0"}, steps, SolveResult("hand", "heuristic"))

    freed = plan(Compute("neg", "cpu:0"), Compute("relu", "cpu:0"), Free("a", "cpu:0"))
    kept = plan(Compute("neg", "cpu:0"), Compute("relu", "cpu:0"))
    copied = plan(Compute("neg", "cpu:0"), Copy("a", "cpu:0", "cpu:1"), Compute("relu", "cpu:0"), Free("a", "cpu:0"))
    for p, reuse in ((freed, {1: "a"}), (kept, {}), (copied, {})):
        ex = Executor(graph, p, overlap=True)
        assert ex.reuse == reuse
        out = ex({"x": x}).outputs
        assert torch.equal(out["b"], torch.relu(-x))
        ex.close()
    assert Executor(graph, freed, watch=frozenset({"a"})).reuse == {}  # the wrapper keeps watched tensors
    assert Executor(graph, freed, inplace=False).reuse == {}


def test_failure_names_the_step_and_does_not_hang() -> None:
    graph, env = _pair_graph()
    plan = _pair_plan(graph)

    def broken(ex, i, s):
        def run(st):
            raise RuntimeError("link down")

        return run

    ex = Executor(graph, plan, table={Copy: broken}, overlap=True)
    with pytest.raises(XschedError, match="link down") as e:
        ex(env)
    assert e.value.step == 1
    ex.close()


def test_bad_inputs_are_clear_errors() -> None:
    graph, env = _pair_graph()
    plan = _pair_plan(graph)
    ex = Executor(graph, plan, overlap=True)
    with pytest.raises(XschedError, match="no tensor given") as e:
        ex({})
    assert e.value.value == "x"
    st = ex.start(env)
    with pytest.raises(XschedError, match="cannot run steps"):
        ex.run(st, 2)
    with pytest.raises(XschedError, match="only graph inputs left out") as e:
        ex.bind(st, {"a": torch.zeros(4096)})
    assert e.value.value == "a"
    ex.close()
    bad = Plan(graph.fingerprint, {}, {"x": "cpu:0"}, (Compute("neg", "cpu:0"),), SolveResult("hand", "heuristic"))
    with pytest.raises(PlanError, match="not resident"):
        Executor(graph, bad)
    with pytest.raises(PlanError, match="plan is for graph"):
        Executor(graph, Plan("other", {}, {"x": "cpu:0"}, (), SolveResult("hand", "heuristic")))


def test_independent_lanes_overlap() -> None:
    """compute A on cpu:0 blocks until compute B on cpu:1 (later in the plan) has run: only concurrent lanes
    finish this plan; run in plan order, A would time out."""
    values = (
        Value("x", 16, "input", (4,), "float32", name="input:0"),
        Value("y", 16, "input", (4,), "float32", name="input:1"),
        Value("a", 16, "activation", (4,), "float32"),
        Value("b", 16, "activation", (4,), "float32"),
    )
    ops = (
        Op("A", "aten.relu.default", ("x",), ("a",), "fwd", call={"args": [{"ref": "x"}], "outs": [[]]}),
        Op("B", "aten.neg.default", ("y",), ("b",), "fwd", call={"args": [{"ref": "y"}], "outs": [[]]}),
    )
    graph = Graph("two", values, ops, ("a", "b"))
    steps = (Compute("A", "cpu:0"), Compute("B", "cpu:1"))
    plan = Plan(graph.fingerprint, {}, {"x": "cpu:0", "y": "cpu:1"}, steps, SolveResult("hand", "heuristic"))
    b_ran = threading.Event()

    def gated(ex, i, s):
        inner = STEP_KINDS[Compute](ex, i, s)

        def run(st):
            if s.op == "A" and not b_ran.wait(timeout=10):
                raise RuntimeError("B never ran while A waited: the lanes did not overlap")
            inner(st)
            if s.op == "B":
                b_ran.set()

        return run

    ex = Executor(graph, plan, table={Compute: gated}, overlap=True)
    out = ex({"x": torch.ones(4), "y": torch.ones(4)}).outputs
    assert_close(out["b"], -torch.ones(4))
    ex.close()


def test_random_ops_draw_in_plan_order_across_lanes() -> None:
    """Two dropout-like draws on two devices share the CPU generator: the second waits for the first, and a
    recomputation replays the first draw, so the numbers equal a sequential eager run."""

    def draw(i: str, src: str) -> Op:
        return Op(i, "aten.bernoulli.p", (src,), (f"m{i}",), "fwd", call={"args": [{"ref": src}, 0.5], "outs": [[]]})

    values = (
        Value("x", 256, "input", (64,), "float32", name="input:0"),
        Value("y", 256, "input", (64,), "float32", name="input:1"),
        Value("mA", 256, "activation", (64,), "float32"),
        Value("mB", 256, "activation", (64,), "float32"),
    )
    graph = Graph("draws", values, (draw("A", "x"), draw("B", "y")), ("mA", "mB"))
    steps = (Compute("A", "cpu:0"), Compute("B", "cpu:1"), Free("mA", "cpu:0"), Compute("A", "cpu:0"))
    plan = Plan(graph.fingerprint, {}, {"x": "cpu:0", "y": "cpu:1"}, steps, SolveResult("hand", "heuristic"))
    ex = Executor(graph, plan, overlap=True)
    assert 0 in ex.deps[1]  # B's first draw waits for A's
    env = {"x": torch.rand(64), "y": torch.rand(64)}
    torch.manual_seed(11)
    got = ex(env).outputs
    after = torch.rand(1)
    torch.manual_seed(11)
    want_a, want_b = torch.bernoulli(env["x"], 0.5), torch.bernoulli(env["y"], 0.5)
    assert torch.equal(got["mA"], want_a) and torch.equal(got["mB"], want_b)
    assert torch.equal(after, torch.rand(1))  # the recomputation left the generator where eager leaves it
    ex.close()


def test_an_unknown_copy_pool_is_one_clear_error() -> None:
    from conftest import chain_graph

    from xsched.solve.reference import eager_plan

    g = chain_graph([8, 8])
    with pytest.raises(XschedError, match="copy_pool must be one of side, compute, not 'pinned'"):
        Executor(g, eager_plan(g, "cpu"), copy_pool="pinned")
