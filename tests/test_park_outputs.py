"""A forward output parked on a store for good (the plan ends with it there, not on the computing device), executed
on cpu:0 with cpu:1 as the store, through the executor and through wrap: eager PyTorch's outputs, gradients and
buffers."""

from __future__ import annotations

import copy
import functools
from dataclasses import replace

import pytest
import torch
from executor_support import check_against_eager, eager_reference, workload
from oracle import assert_prediction_matches
from oracle import makespan as oracle_makespan
from torch.testing import assert_close
from torch.utils._pytree import tree_flatten

from xsched.contracts.graph import Graph
from xsched.contracts.plan import Compute, Copy, Free, Plan, Step, autograd_boundary, place_frees
from xsched.contracts.profile import DeviceInfo, LinkCost, OpCost, Profile
from xsched.contracts.result import SolveResult
from xsched.execute.wrap import wrap
from xsched.interpret import PlanInterpreter
from xsched.simulate import simulate
from xsched.solve.autograd_boundary import forward_outputs, missing_at_boundary

pytestmark = pytest.mark.usefixtures("one_thread")

DEVICES = ("cpu:0", "cpu:1")


def store_profile(graph: Graph) -> Profile:
    """cpu:0 runs every op in 1 ms; cpu:1 only stores, over a link each way."""
    link = LinkCost(1e-6, 5e10)
    return Profile(
        graph.fingerprint,
        {d: DeviceInfo("cpu") for d in DEVICES},
        {"cpu:0": {o.id: OpCost(1e-3) for o in graph.ops}, "cpu:1": {}},
        {"cpu:0->cpu:1": link, "cpu:1->cpu:0": link},
    )


def parked_plan() -> tuple[Graph, Plan, Profile]:
    """The zoo transformer's eager order on cpu:0 with its output (the logits) copied to cpu:1 right after it is
    made and freed on cpu:0 right after backward starts: the plan ends with the logits on the store alone."""
    return _parked_plan()


@functools.cache
def _parked_plan() -> tuple[Graph, Plan, Profile]:
    _, graph = workload("transformer")
    profile = store_profile(graph)
    homes = {v: "cpu:0" for v in graph.inputs}
    logits = max(forward_outputs(graph), key=lambda v: graph.value[v].nbytes)
    steps: list[Step] = []
    for o in graph.ops:
        steps.append(Compute(o.id, "cpu:0"))
        if logits in o.outputs:
            steps.append(Copy(logits, "cpu:0", "cpu:1"))
    steps = list(place_frees(graph, steps, homes))
    if Free(logits, "cpu:0") in steps:  # placing frees may end it after its last read, before the boundary
        steps.remove(Free(logits, "cpu:0"))
    b = autograd_boundary(graph, steps)
    assert b is not None
    steps.insert(b + 1, Free(logits, "cpu:0"))
    plan = Plan(graph.fingerprint, {}, homes, tuple(steps), SolveResult("hand", "heuristic"), boundary=b)
    sim = simulate(graph, plan, profile)
    plan = replace(plan, predicted=sim.prediction())
    assert_prediction_matches(graph, plan, profile)
    assert plan.predicted.makespan_s == pytest.approx(oracle_makespan(graph, plan, profile))
    return graph, plan, profile


def ends_on(graph: Graph, plan: Plan) -> dict[str, list[str]]:
    """Each forward output -> the devices holding it when the plan ends."""
    walk = PlanInterpreter(graph, plan)
    walk.run()
    return {v: [d for d in DEVICES if v in walk.resident[d]] for v in forward_outputs(graph)}


def test_the_logits_end_on_the_store_and_are_not_computed_again() -> None:
    """The logits end on cpu:1 alone, made once; they are resident when backward starts, where wrap returns
    them, so the plan needs no repair."""
    graph, plan, _ = parked_plan()
    logits = max(forward_outputs(graph), key=lambda v: graph.value[v].nbytes)
    assert ends_on(graph, plan)[logits] == ["cpu:1"]
    producer = graph.producer[logits]
    assert sum(isinstance(s, Compute) and s.op == producer for s in plan.steps) == 1
    assert missing_at_boundary(graph, plan) == []


def test_a_plan_ending_with_a_parked_output_runs_like_eager() -> None:
    """The executor, step by step with the trace and on its lanes, gives eager's outputs (the parked one read from
    the store), gradients and buffers."""
    _, plan, _ = parked_plan()
    check_against_eager("transformer", plan, trace=True).close()
    check_against_eager("transformer", plan, trace=False, overlap=True).close()


def test_wrap_hands_back_the_parked_output_on_its_device() -> None:
    """Through wrap with cpu:1 as the store: the user's outputs, held across the backward as a training loop holds
    them, are eager's, on the device eager gives them, and so are the gradients and buffers after the step."""
    graph, plan, _ = parked_plan()
    z = workload("transformer")[0]
    outs, grads, buffers = eager_reference("transformer", seed=7)
    model = copy.deepcopy(z.model)
    w = wrap(model, z.inputs, {}, plan=plan, stores=("cpu:1",))
    torch.manual_seed(7)
    got = [o for o in tree_flatten(w(*z.inputs))[0] if isinstance(o, torch.Tensor)]
    diff = [o for o in got if o.requires_grad]
    torch.autograd.backward(diff, [torch.ones_like(o) for o in diff])
    assert len(got) == len(outs)
    for a, b in zip(got, outs):
        assert a.device == b.device
        assert_close(a.detach(), b.detach(), rtol=1e-5, atol=1e-6)
    for n, p in model.named_parameters():
        if grads[n] is not None:
            assert_close(p.grad, grads[n], rtol=1e-5, atol=1e-6, msg=lambda m, n=n: f"grad of {n}: {m}")
    for n, b in model.named_buffers():
        assert_close(b, buffers[n], rtol=1e-5, atol=1e-6, msg=lambda m, n=n: f"buffer {n}: {m}")
