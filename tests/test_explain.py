"""`explain`: each value's decision (kept, recomputed, moved) and its reason, on hand-made plans whose answer is known."""

from __future__ import annotations

from conftest import chain_graph
from test_milp import profile_for

from xsched.contracts.plan import Compute, Copy, Free, Plan
from xsched.contracts.profile import LinkCost
from xsched.contracts.result import SolveResult
from xsched.explain import explain, explain_table, summary

G = chain_graph([16, 32, 8])  # x(8) -> f0 -> a0(16) -> f1 -> a1(32) -> f2 -> a2(8)


def test_a_value_freed_and_recomputed_says_what_keeping_it_would_need() -> None:
    g = chain_graph([16, 32, 8], train=True)  # backward: b2(a2, a1) -> g2, b1(g2, a0) -> g1, b0(g1, x) -> g0
    steps = [
        Compute("f0", "cpu"),
        Compute("f1", "cpu"),
        Free("a0", "cpu"),
        Compute("f2", "cpu"),
        Compute("b2", "cpu"),
        Free("a2", "cpu"),
        Free("a1", "cpu"),
        Compute("f0", "cpu"),
        Compute("b1", "cpu"),
        Free("g2", "cpu"),
        Free("a0", "cpu"),
        Compute("b0", "cpu"),
        Free("g1", "cpu"),
    ]
    prof = profile_for(g, {"cpu": {o.id: 0.002 for o in g.ops}})
    plan = Plan(g.fingerprint, {"cpu": 64}, {"x": "cpu"}, tuple(steps), SolveResult("hand", "heuristic"))
    rows = {r.value: r for r in explain(g, plan, prof)}
    a0 = rows["a0"]
    assert a0.decision == "recomputed" and a0.devices == ("cpu", "cpu")
    # kept from its free (step 2) to its recompute (step 7), a0's 16 B would sit on top of the most in use between:
    # 56 B while b2 runs (step 4: x 8 + a1 32 + a2 8 + g2 8), so 72 B against a budget of 64 B
    assert a0.reasons == (
        "freed on cpu at step 2, recomputed at step 7 (2 ms): keeping it would need 72 B on cpu, "
        "over its budget of 64 B",
    )
    assert rows["a1"].decision == "kept" and "last read at step 4" in rows["a1"].reasons[0]
    assert rows["g0"].decision == "kept" and "graph output" in rows["g0"].reasons[0]
    assert summary(tuple(rows.values()))["recomputed"] == 1
    assert "a0" in explain_table(tuple(rows.values()))


def test_a_copy_for_a_faster_device_names_both_times() -> None:
    steps = [
        Compute("f0", "cpu"),
        Copy("a0", "cpu", "gpu"),
        Free("a0", "cpu"),
        Compute("f1", "gpu"),
        Copy("a1", "gpu", "cpu"),
        Free("a1", "gpu"),
        Compute("f2", "cpu"),
    ]
    times = {"cpu": {"f0": 1.0, "f1": 0.5, "f2": 1.0}, "gpu": {"f0": 0.1, "f1": 0.05, "f2": 0.1}}
    prof = profile_for(G, times, {"cpu->gpu": LinkCost(0.0, 1e9), "gpu->cpu": LinkCost(0.0, 1e9)})
    plan = Plan(G.fingerprint, {}, {"x": "cpu"}, tuple(steps), SolveResult("hand", "heuristic"))
    rows = {r.value: r for r in explain(G, plan, prof)}
    assert rows["a0"].decision == "moved" and rows["a0"].copies == ((1, "cpu", "gpu"),)
    assert "f1 runs on gpu: 50 ms there, 500 ms on cpu" in rows["a0"].reasons[0]
    assert rows["a1"].decision == "moved" and "for f2 at step 6" in rows["a1"].reasons[0]


def test_explain_says_what_the_caching_allocator_is_expected_to_reserve() -> None:
    from xsched.explain import reserved_text
    from xsched.solve.reference import eager_plan

    g = chain_graph([3 << 20, 5 << 20, 12 << 20])
    text = reserved_text(g, eager_plan(g, "cuda:0"))
    # tests/test_allocator.py counts this plan by hand: 22 MiB reserved for a peak of 17 MiB + 8 B (+29.4%)
    assert text.startswith("caching allocator") and "reserved ~22.00 MiB, +29.4% over the plan's peak" in text
    # 22 MiB reserved, 17 MiB + 512 B allocated at most (test_allocator counts them): 5 MiB less 512 B
    assert "cuda:0: predicted reserved 22.00 MiB (fragmentation 5.00 MiB; the host a step ahead" in text
    # expandable: a0 [0, 3) and a1 [3, 8) of one 20 MiB page, a2 the free [8, 20): the same 22 MiB
    assert "with expandable segments ~22.00 MiB, +29.4%" in text
    # the chain's values record no dtype or layout: none can go in an arena (tests/test_explain_arena.py sizes one)
    assert "with planned addresses (--planned-addresses) the same: no value" in text
    assert reserved_text(g, eager_plan(g, "cpu")) == ""  # the host has no such allocator
    from test_allocator import parked_plan

    text = reserved_text(*parked_plan())  # 14 MiB with the GPU keeping up, 26 MiB with the host ahead (counted there)
    assert "reserved ~14.00 MiB to 26.00 MiB" in text and "A range runs from" in text
    assert "predicted reserved 26.00 MiB" in text  # the upper end: what planning fits to the budget
    # expandable segments: a's 20 MiB page (and 2 MiB for x, y), b takes a's block again, or with the host ahead
    # (a's block held) maps a second page: 22 to 42 MiB, counted in tests/test_allocator_expandable.py's way
    assert "with expandable segments ~22.00 MiB to 42.00 MiB" in text
