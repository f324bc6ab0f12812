"""The offload benchmark's hidden-copy share (scripts/bench_offload.py hidden_share) on hand-made plans."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from xsched.contracts.graph import Graph, Op, Value
from xsched.contracts.plan import Compute, Copy, Free, Plan
from xsched.contracts.profile import DeviceInfo, LinkCost, OpCost, Profile
from xsched.contracts.result import SolveResult

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))  # its report module beside it
_spec = importlib.util.spec_from_file_location(
    "bench_offload", Path(__file__).resolve().parents[1] / "scripts" / "bench_offload.py"
)
bench = importlib.util.module_from_spec(_spec)  # type: ignore[arg-type]
sys.modules["bench_offload"] = bench
_spec.loader.exec_module(bench)  # type: ignore[union-attr]


def parked_a(free_early: bool = False) -> tuple[Graph, Plan]:
    """f0 makes a, f1 and f2 run without it, f3 reads it again: a goes to the store "h" after f0 and comes back
    for f3. Its free on "g" comes after f1 (so f1 need not wait for the copy out), or with `free_early` right
    after the copy out, which every later compute on "g" then waits for (an allocation waits for earlier frees)."""
    values = tuple(Value(v, 100, "input" if v == "x" else "activation") for v in ("x", "a", "b", "c", "d"))
    ops = (
        Op("f0", "t", ("x",), ("a",)),
        Op("f1", "t", ("x",), ("b",)),
        Op("f2", "t", ("b",), ("c",)),
        Op("f3", "t", ("a", "c"), ("d",)),
    )
    graph = Graph("parked", values, ops, ("d",))
    free, f1 = Free("a", "g"), Compute("f1", "g")
    steps = (Compute("f0", "g"), Copy("a", "g", "h"), *((free, f1) if free_early else (f1, free)))
    steps += (Copy("a", "h", "g"), Compute("f2", "g"), Compute("f3", "g"))
    return graph, Plan(graph.fingerprint, {}, {"x": "g"}, steps, SolveResult("hand", "heuristic"))


def profile(graph: Graph, copy_s: float) -> Profile:
    """Every op 1 s on "g" (none on "h"), every copy `copy_s` either way."""
    link = LinkCost(copy_s, 1e30)
    return Profile(
        graph.fingerprint,
        {"g": DeviceInfo("gpu"), "h": DeviceInfo("cpu")},
        {"g": {o.id: OpCost(1.0) for o in graph.ops}, "h": {}},
        {"g->h": link, "h->g": link},
    )


@pytest.mark.parametrize(
    ("copy_s", "makespan"),
    [
        (0.5, 4.0),  # out 1-1.5 s under f1, back 1.5-2 s under f1: nothing exposed
        (1.5, 5.0),  # out 1-2.5, f2 waits for the free (2.5-3.5), back 2.5-4: f3 at 4-5, not 3-4
        (2.0, 6.0),  # out 1-3, f2 3-4, back 3-5: f3 at 5-6
    ],
)
def test_hidden_share_of_a_parked_value(copy_s: float, makespan: float) -> None:
    graph, plan = parked_a()
    total, share = bench.hidden_share(graph, plan, profile(graph, copy_s))
    assert total == pytest.approx(2 * copy_s)
    assert share == pytest.approx(1.0 - (makespan - 4.0) / total)  # 4 s: the four ops with free copies


def test_a_free_right_after_the_copy_out_exposes_it() -> None:
    graph, plan = parked_a(free_early=True)
    total, share = bench.hidden_share(graph, plan, profile(graph, 0.5))
    assert (total, share) == pytest.approx((1.0, 0.5))  # f1 waits for the copy out; the copy back hides under f1


def test_no_copies_no_share() -> None:
    graph, plan = parked_a()
    plain = Plan(
        plan.graph, {}, plan.homes, tuple(Compute(o.id, "g") for o in graph.ops), SolveResult("hand", "heuristic")
    )
    assert bench.hidden_share(graph, plain, profile(graph, 1.0)) == (0.0, None)
