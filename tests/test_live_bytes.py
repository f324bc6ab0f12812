"""Peak fidelity: the simulator's peak of every plan against an independent allocator-level count (live storages per
logical device, xsched.execute.live_bytes) of the plan run by the executor on cpu:0 (compute) + cpu:1 (store)."""

from __future__ import annotations

import functools

import pytest
import torch

from xsched import zoo
from xsched.capture.torch import bind_inputs, capture
from xsched.contracts.graph import Graph
from xsched.contracts.profile import DeviceInfo, LinkCost, OpCost, Profile
from xsched.execute.live_bytes import LiveBytes, measured_peaks
from xsched.simulate import simulate
from xsched.solve import SolverOptions, solve

pytestmark = pytest.mark.usefixtures("one_thread")
TWO = ("cpu:0", "cpu:1")


def test_counts_storages_by_hand() -> None:
    count = LiveBytes()
    with count:
        count.device = "a"
        x = torch.zeros(100)  # 400 B
        v = x.view(10, 10)  # a view: no new storage
        count.device = "b"
        y = x.clone()  # 400 B on b
        x.add_(1)  # in place: nothing new
        del x
        assert count.used == {"a": 400, "b": 400}  # `v` keeps x's storage alive
        del v
        z = torch.cat([y, y])  # 800 B on b
    assert count.used == {"a": 0, "b": 1200} and count.peak == {"a": 400, "b": 1200}
    del y, z
    assert count.used == {"a": 0, "b": 0}


def store_profile(graph: Graph) -> Profile:
    """cpu:0 runs every op in a time that grows with its outputs' bytes; cpu:1 stores; a link each way."""
    cost = {o.id: OpCost(1e-4 + sum(graph.value[v].nbytes for v in o.outputs) * 1e-9) for o in graph.ops}
    link = LinkCost(1e-5, 2e9)
    return Profile(
        graph.fingerprint,
        {d: DeviceInfo("cpu") for d in TWO},
        {"cpu:0": cost, "cpu:1": {}},
        {"cpu:0->cpu:1": link, "cpu:1->cpu:0": link},
    )


# name -> (batch, scale, budget in % of the eager peak: above the lower bound, below eager)
MODELS = {"gpt2": (8, "tiny:n_layer=2", 60), "resnet18": (16, "tiny", 80)}


@functools.cache
def captured(name: str) -> tuple[Graph, dict[str, torch.Tensor]]:
    batch, scale, _ = MODELS[name]
    torch.manual_seed(0)
    z = zoo.build(name, batch=batch, scale=scale)
    graph = capture(z.model, z.inputs, name=name)
    return graph, bind_inputs(graph, z.model, z.inputs)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_predicted_peaks_are_the_counted_peaks(name: str) -> None:
    """Every plan's predicted peak per device (less its homed inputs) within 3% of the bytes counted live."""
    graph, env = captured(name)
    pct = MODELS[name][2]
    profile = store_profile(graph)
    homes = {v: "cpu:0" for v in graph.inputs}
    plans = {"eager": solve(graph, profile, {}, ["cpu:0"], "eager", homes=homes)}
    for method in ("checkpoint", "park"):
        devices = ["cpu:0"] if method == "checkpoint" else list(TWO)
        budgets = {"cpu:0": f"{pct}%", **({"cpu:1": "100%"} if method == "park" else {})}
        plans[method] = solve(graph, profile, budgets, devices, method, SolverOptions(time_limit_s=1), homes=homes)
    assert plans["park"].predicted.peak_bytes["cpu:1"] > 0  # something is parked on the store
    for label, plan in plans.items():
        sim = simulate(graph, plan, profile, check_budgets=False)
        got = measured_peaks(graph, plan, env)
        for d in plan.devices:
            homed = sum(graph.value[v].nbytes for v, h in plan.homes.items() if h == d)
            want = sim.peak_bytes[d] - homed
            assert abs(got[d] - want) <= 0.03 * max(want, got[d]), (label, d, want, got[d])


def test_a_finished_run_on_the_lanes_leaves_nothing_alive() -> None:
    """The lane threads drop each task once run: a finished run's state (its outputs, its tensors) is released when
    its caller drops it, not when a lane gets the next run's first task (which hid it in the next run's baseline)."""
    import gc
    import weakref

    from xsched.execute.executor import Executor

    graph, env = captured("gpt2")
    profile = store_profile(graph)
    homes = {v: "cpu:0" for v in graph.inputs}
    budgets = {"cpu:0": "60%", "cpu:1": "100%"}
    plan = solve(graph, profile, budgets, list(TWO), "park", SolverOptions(time_limit_s=1), homes=homes)
    assert any(s.src == "cpu:0" for s in plan.steps if hasattr(s, "src"))  # copies: the plan runs on the lanes
    ex = Executor(graph, plan, overlap=True)
    try:
        st = ex.start(env)
        ex.run(st)
        logits = weakref.ref(ex.outputs(st)[graph.outputs[0]])
        del st
        gc.collect()
        assert logits() is None
    finally:
        ex.close()
