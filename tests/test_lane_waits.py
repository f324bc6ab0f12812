"""The lanes' waits as a transitive reduction (xsched.lanes.reduce_waits): by hand (a copied-in value's free waits
for its read, not the copy; two waits that imply a third), against a brute-force happens-before closure on random
plans and gpt2's park plan (the same closure, and no kept wait implied by another), and the overlapped spans equal
to those of the unreduced waits, so the simulator's makespans and peaks, and every plan, stay what they were."""

from __future__ import annotations

import random
from collections.abc import Sequence
from functools import cache

from executor_support import workload
from hypothesis import given, settings
from hypothesis import strategies as st
from test_lanes import split_plan
from test_simulate import random_dags

from xsched.contracts.graph import Graph, Op, Value
from xsched.contracts.plan import Compute, Copy, Free, Plan, Step
from xsched.contracts.profile import DeviceInfo, LinkCost, OpCost, Profile
from xsched.lanes import direct_waits, inline_free_lanes, lane_of, overlapped_spans, reduce_waits, step_waits
from xsched.solve import solve
from xsched.solve.reference import eager_peak

DEVICES = ("cpu:0", "cpu:1")


def streamed_weight() -> tuple[Graph, list[Step]]:
    """A weight homed on cpu:1 copied to cpu:0, read by a matmul there, then freed there."""
    g = Graph(
        "streamed",
        (Value("x", 16, "input"), Value("w", 16, "param"), Value("y", 16)),
        (Op("mm", "aten.mm.default", ("x", "w"), ("y",)),),
        ("y",),
    )
    return g, [Copy("w", "cpu:1", "cpu:0"), Compute("mm", "cpu:0"), Free("w", "cpu:0")]


def test_a_copied_in_values_free_waits_for_its_read_not_the_copy_and_runs_inline() -> None:
    g, steps = streamed_weight()
    assert direct_waits(g, steps) == [(), (0,), (0, 1)]  # the free: the copy that made w there, and its read
    assert step_waits(g, steps) == [(), (0,), (1,)]  # the read waited for the copy
    lanes = inline_free_lanes(g, steps)
    assert lanes == ["copy:cpu:1->cpu:0", "compute:cpu:0", "compute:cpu:0"]
    assert step_waits(g, steps, lanes=lanes) == [(), (0,), ()]  # behind its read on its own lane


def test_two_waits_that_imply_a_third_drop_it() -> None:
    """relu makes `a` on cpu:0, copied to cpu:1 and to cpu:2; a's free on cpu:0 waits for both copies (its reads),
    each of which waited for relu (made it, and the compute before it): relu's wait goes, the free stays off the
    compute lane, and a chain (neg on cpu:1 after the copy) implies the copy for a's free there."""
    g = Graph(
        "diamond",
        (Value("x", 8, "input"), Value("a", 8), Value("b", 8)),
        (Op("relu", "aten.relu.default", ("x",), ("a",)), Op("neg", "aten.neg.default", ("a",), ("b",))),
        ("b",),
    )
    steps = [
        Compute("relu", "cpu:0"),
        Copy("a", "cpu:0", "cpu:1"),
        Copy("a", "cpu:0", "cpu:2"),
        Free("a", "cpu:0"),
        Compute("neg", "cpu:1"),
        Free("a", "cpu:1"),
    ]
    assert direct_waits(g, steps) == [(), (0,), (0,), (0, 1, 2), (1,), (1, 4)]
    assert step_waits(g, steps) == [(), (0,), (0,), (1, 2), (1,), (4,)]
    assert inline_free_lanes(g, steps) == [lane_of(s) for s in steps[:5]] + ["compute:cpu:1"]


def happens_before(waits: Sequence[Sequence[int]], lanes: Sequence[str]) -> list[int]:
    """Per step, a bitmask of every step that completes before it starts: its waits, the step before it on its
    lane, and theirs, by the definition (no vector clocks)."""
    before: list[int] = []
    last: dict[str, int] = {}
    for i, deps in enumerate(waits):
        prior = [*deps, last[lanes[i]]] if lanes[i] in last else list(deps)
        mask = 0
        for j in prior:
            mask |= (1 << j) | before[j]
        before.append(mask)
        last[lanes[i]] = i
    return before


def check_reduction(direct: Sequence[Sequence[int]], lanes: Sequence[str]) -> list[tuple[int, ...]]:
    """reduce_waits keeps every ordering (same closure), keeps only waits among the direct ones, and keeps none that
    another kept wait or the step before on the lane implies."""
    reduced = reduce_waits(direct, lanes)
    assert happens_before(reduced, lanes) == (closure := happens_before(direct, lanes))
    last: dict[str, int] = {}
    for i, (deps, kept) in enumerate(zip(direct, reduced, strict=True)):
        assert set(kept) <= set(deps) and list(kept) == sorted(kept)
        implied = closure[last[lanes[i]]] | (1 << last[lanes[i]]) if lanes[i] in last else 0
        for j in kept:
            assert not (implied >> j) & 1, f"step {i}'s wait for {j} is implied by its lane"
            assert not any((closure[k] >> j) & 1 for k in kept if k != j), f"step {i}'s wait for {j} is implied"
        last[lanes[i]] = i
    return reduced


def spans_equal(steps: Sequence[Step], direct: Sequence[Sequence[int]], lanes: Sequence[str], seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(5):  # frees and copies with zero time included: ties are where an order could slip
        durations = [rng.choice([0.0, rng.uniform(0.0, 3.0)]) for _ in steps]
        reduced = reduce_waits(direct, lanes)
        assert overlapped_spans(steps, durations, reduced, lanes) == overlapped_spans(steps, durations, direct, lanes)


@settings(max_examples=120, deadline=None, derandomize=True)
@given(random_dags(), st.data())
def test_random_two_device_plans_reduce_to_the_same_order_and_spans(g, data) -> None:
    where = {o.id: data.draw(st.sampled_from(["a", "b"])) for o in g.ops}
    times = {o.id: data.draw(st.floats(0.0, 3.0)) for o in g.ops}
    plan, _ = split_plan(g, where, times)
    randoms = {o.id for o in g.ops if data.draw(st.booleans())}
    for lanes in ([lane_of(s) for s in plan.steps], inline_free_lanes(g, plan.steps)):
        direct = direct_waits(g, plan.steps, randoms, lanes)
        assert check_reduction(direct, lanes) == step_waits(g, plan.steps, randoms, lanes)
        spans_equal(plan.steps, direct, lanes, seed=len(plan.steps))


@cache
def gpt2_park() -> tuple[Graph, Plan]:
    """gpt2 (tiny) trained with a park plan at 30% of its eager peak on cpu:0, its weights homed on cpu:1 (the
    store) and streamed in, over a link slow enough that it parks and recomputes too."""
    _, graph = workload("gpt2")
    link = LinkCost(1e-4, 3e7)
    profile = Profile(
        graph.fingerprint,
        {d: DeviceInfo("cpu") for d in DEVICES},
        {"cpu:0": {o.id: OpCost(1e-3) for o in graph.ops}, "cpu:1": {}},
        {"cpu:0->cpu:1": link, "cpu:1->cpu:0": link},
    )
    homes = {v: "cpu:1" if graph.value[v].kind == "param" else "cpu:0" for v in graph.inputs}
    budgets = {"cpu:0": int(0.3 * eager_peak(graph))}
    return graph, solve(graph, profile, budgets, DEVICES, "park", homes=homes)


def test_gpt2_park_plan_reduces_to_the_same_order_and_spans_and_inlines_more_frees() -> None:
    g, plan = gpt2_park()
    steps = plan.steps
    assert any(isinstance(s, Copy) and s.dst == "cpu:0" for s in steps) and plan.solver.stats.parked > 0
    plain = [lane_of(s) for s in steps]
    inline = inline_free_lanes(g, steps)
    for lanes in (plain, inline):
        direct = direct_waits(g, steps, (), lanes)
        check_reduction(direct, lanes)
        spans_equal(steps, direct, lanes, seed=7)
    # before the reduction a free ran inline only when its direct waits were all on the compute lane
    before = sum(
        isinstance(s, Free) and all(plain[j] == f"compute:{s.device}" for j in deps)
        for s, deps in zip(steps, direct_waits(g, steps), strict=True)
    )
    after = sum(isinstance(s, Free) and lane.startswith("compute:") for s, lane in zip(steps, inline, strict=True))
    assert after > before, (before, after)
    # every inline free waits for nothing off its lane
    waits = step_waits(g, steps, (), inline)
    assert all(not waits[i] for i, s in enumerate(steps) if isinstance(s, Free) and inline[i].startswith("compute:"))
