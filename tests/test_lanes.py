"""The overlapped model (xsched.lanes): waits by hand, and on random two-device plans the invariants the
simulator's makespan and the executor's lanes rely on."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from test_simulate import make_plan, random_dags

from xsched.contracts.graph import Graph, Op, Value
from xsched.contracts.plan import Compute, Copy, Free, Plan
from xsched.contracts.profile import DeviceInfo, LinkCost, OpCost, Profile
from xsched.contracts.result import SolveResult
from xsched.lanes import inline_free_lanes, lane_of, overlapped_spans, step_waits
from xsched.simulate import simulate
from xsched.solve.heuristics.routing import insert_copies


def pair() -> tuple[Graph, Plan]:
    """relu on cpu:0, its output copied to cpu:1 and negated there."""
    g = Graph(
        "pair",
        (Value("x", 16, "input"), Value("a", 16), Value("b", 16)),
        (Op("relu", "aten.relu.default", ("x",), ("a",)), Op("neg", "aten.neg.default", ("a",), ("b",))),
        ("b",),
    )
    steps = (Compute("relu", "cpu:0"), Copy("a", "cpu:0", "cpu:1"), Free("a", "cpu:0"), Compute("neg", "cpu:1"))
    steps += (Free("a", "cpu:1"),)
    return g, Plan(g.fingerprint, {}, {"x": "cpu:0"}, steps, SolveResult("test", "heuristic"))


def test_waits_by_hand() -> None:
    g, plan = pair()
    assert [lane_of(s) for s in plan.steps] == [
        "compute:cpu:0",
        "copy:cpu:0->cpu:1",
        "free:cpu:0",
        "compute:cpu:1",
        "free:cpu:1",
    ]
    # the copy waits for relu; each free for the step that put `a` there and its reads, less the waits a read implies
    # (the copy waited for relu, neg for the copy); neg for the copy
    assert step_waits(g, plan.steps) == [(), (0,), (1,), (1,), (3,)]


def test_first_draws_of_random_ops_wait_for_each_other_across_lanes() -> None:
    g = Graph(
        "draws",
        (Value("x", 4, "input"), Value("y", 4, "input"), Value("m", 4), Value("n", 4)),
        (Op("d0", "t", ("x",), ("m",)), Op("d1", "t", ("y",), ("n",))),
        ("m", "n"),
    )
    steps = (Compute("d0", "a"), Compute("d1", "b"))
    assert step_waits(g, steps) == [(), ()]
    assert step_waits(g, steps, random_ops={"d0", "d1"}) == [(), (0,)]


def split_plan(g: Graph, where: dict[str, str], times: dict[str, float]) -> tuple[Plan, Profile]:
    profile = Profile(
        g.fingerprint,
        {"a": DeviceInfo("cpu"), "b": DeviceInfo("cpu")},
        {d: {o.id: OpCost(times[o.id] * (1 if d == "a" else 2)) for o in g.ops} for d in ("a", "b")},
        {"a->b": LinkCost(0.5, 20.0), "b->a": LinkCost(0.25, 40.0)},
    )
    homes = {v: "a" for v in g.inputs}
    return make_plan(g, insert_copies(g, where, homes, profile), homes), profile


def overlapped_peaks(g: Graph, plan: Plan, spans: list[tuple[float, float]]) -> dict[str, int]:
    """Bytes per device over time when every step runs in its span: a compute holds its outputs and workspace
    from its start, a copy its value on the destination from its start, a free releases at its end. Events at
    one time go in plan order, so a free counts as done before an allocation only if the plan says so."""
    events: list[tuple[float, int, str, int]] = []  # (time, step index, device, delta)
    for i, (s, (start, end)) in enumerate(zip(plan.steps, spans)):
        if isinstance(s, Compute):
            op = g.op[s.op]
            events.append((start, i, s.device, sum(g.value[v].nbytes for v in op.outputs) + op.workspace_bytes))
            events.append((end, i, s.device, -op.workspace_bytes))
        elif isinstance(s, Copy):
            events.append((start, i, s.dst, g.value[s.value].nbytes))
        else:
            events.append((end, i, s.device, -g.value[s.value].nbytes))
    used = {d: sum(g.value[v].nbytes for v, h in plan.homes.items() if h == d) for d in plan.devices}
    peak = dict(used)
    for _, _, d, delta in sorted(events):
        used[d] += delta
        peak[d] = max(peak[d], used[d])
    return peak


@settings(max_examples=150, deadline=None)
@given(random_dags(), st.data())
def test_overlapped_run_respects_waits_and_never_needs_more_memory_than_the_plan(g, data) -> None:
    where = {o.id: data.draw(st.sampled_from(["a", "b"])) for o in g.ops}
    times = {o.id: data.draw(st.floats(0.0, 3.0)) for o in g.ops}
    plan, profile = split_plan(g, where, times)
    sim = simulate(g, plan, profile)
    spans = list(sim.step_span)
    waits = step_waits(g, plan.steps)
    assert spans == overlapped_spans(plan.steps, [e - s for s, e in spans], waits)
    lane_end: dict[str, float] = {}
    for i, (s, (start, end)) in enumerate(zip(plan.steps, spans)):
        assert all(start >= spans[j][1] for j in waits[i]), f"step {i} starts before a step it waits for"
        assert start >= lane_end.get(lane_of(s), 0.0), f"step {i} overtakes its lane"
        lane_end[lane_of(s)] = end
    assert sim.makespan_s <= sim.time_s + 1e-9
    peaks = overlapped_peaks(g, plan, spans)
    assert all(peaks[d] <= sim.peak_bytes[d] for d in plan.devices), (peaks, sim.peak_bytes)
    # the executor's lanes (frees that wait only on their compute lane run there) keep the same guarantee
    lanes = inline_free_lanes(g, plan.steps)
    inline_waits = step_waits(g, plan.steps, lanes=lanes)
    inline_spans = overlapped_spans(plan.steps, [e - s for s, e in spans], inline_waits, lanes)
    peaks = overlapped_peaks(g, plan, inline_spans)
    assert all(peaks[d] <= sim.peak_bytes[d] for d in plan.devices), (peaks, sim.peak_bytes)
    assert max(e for _, e in inline_spans) <= sim.makespan_s + 1e-9  # frees take no time: nothing waits longer


@settings(max_examples=60, deadline=None)
@given(random_dags(), st.data())
def test_a_device_allocates_and_frees_in_plan_order_on_the_lanes(g, data) -> None:
    """A free waits for the compute before it on its device, as each compute waits for the frees before it: the
    lanes then hold at every compute what the plan counts there, not less (a free that ran ahead of the computes
    before it made an H100 run peak 31-60% below the plan's count). With the frees the executor runs on the
    compute lane too."""
    where = {o.id: data.draw(st.sampled_from(["a", "b"])) for o in g.ops}
    times = {o.id: data.draw(st.floats(0.0, 3.0)) for o in g.ops}
    plan, profile = split_plan(g, where, times)
    durations = [data.draw(st.floats(0.0, 2.0)) for _ in plan.steps]  # any lag, a copy's or a free's included
    for lanes in (None, inline_free_lanes(g, plan.steps)):
        spans = overlapped_spans(plan.steps, durations, step_waits(g, plan.steps, lanes=lanes), lanes)
        for i, s in enumerate(plan.steps):
            if not isinstance(s, Free):
                continue
            for j, t in enumerate(plan.steps):
                if isinstance(t, Compute) and t.device == s.device:
                    if j < i:
                        assert spans[i][1] >= spans[j][1], f"free {i} ends before compute {j} before it ends"
                    else:
                        assert spans[j][0] >= spans[i][1], f"compute {j} starts before free {i} before it ends"
