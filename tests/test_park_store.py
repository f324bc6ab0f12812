"""A value parked in several gaps needs a copy on the store made before each gap: parking a later gap first (its copy
out made where its later residency starts) leaves an earlier gap with none to come back from, so the earlier one
copies out itself, and the later one then comes back from that copy (one copy out in all). On the zoo GPT-2 with
its loss alone in row blocks, the final layer norm's output (read by every block, forward and backward) is dropped
across the autograd boundary, parked in a backward gap, then in a forward gap: the plan is valid and trains as eager
PyTorch does, on cpu:0 with cpu:1 as the store, step by step and on the executor's lanes."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from oracle import assert_prediction_matches
from test_park_dedup import redundant_copies
from torch import nn
from torch.testing import assert_close

from xsched import zoo
from xsched.capture.chunk_loss import chunk_cross_entropy
from xsched.capture.torch import bind_inputs, capture, unpack_outputs
from xsched.contracts.graph import Graph
from xsched.contracts.plan import Copy, Plan
from xsched.contracts.profile import DeviceInfo, LinkCost, OpCost, Profile
from xsched.execute.executor import Executor
from xsched.execute.reference import run_plan
from xsched.solve.heuristics.park import line_plan
from xsched.solve.heuristics.park_model import ParkTimeline

pytestmark = pytest.mark.usefixtures("one_thread")

DEVICES = ("cpu:0", "cpu:1")
BIG = 1 << 40  # no budget: the moves are chosen here, not by the greedy


class LossOnly(nn.Module):
    """The model's loss alone: with the loss chunked, the logits too are made block by block."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        return self.model(*inputs)[1]


@functools.cache
def chunked() -> tuple[nn.Module, tuple, Graph, Profile]:
    """The zoo GPT-2 (tiny) returning its loss alone, its inputs, its graph with the loss in 4 row blocks, costs."""
    z = zoo.build("gpt2", scale="tiny")
    model = LossOnly(z.model)
    g = chunk_cross_entropy(capture(model, z.inputs), 4)
    link = LinkCost(1e-6, 5e10)  # every copy hides behind an op: each park's stall is 0
    profile = Profile(
        g.fingerprint,
        {d: DeviceInfo("cpu") for d in DEVICES},
        {"cpu:0": {o.id: OpCost(1e-3) for o in g.ops}, "cpu:1": {}},
        {"cpu:0->cpu:1": link, "cpu:1->cpu:0": link},
    )
    return model, z.inputs, g, profile


def gap_inside(line: ParkTimeline, v: str, k: int, backward: bool) -> int:
    """A position between two reads of `v` within its span `k`, on the asked side of the autograd boundary."""
    s, e = line.spans[v][k]
    reads = [x for x in line.uses[v] if s <= x <= e]
    return next(a + 1 for a, b in zip(reads, reads[1:]) if b > a + 1 and (a >= line.boundary) == backward)


@functools.cache
def later_gap_parked_first() -> tuple[Graph, Plan, Profile, str]:
    """The final layer norm's output v, dropped across the boundary (made again before its first backward read),
    then parked in a backward gap (copied out where that residency starts), then in a forward gap."""
    *_, g, profile = chunked()
    homes = {v: "cpu:0" for v in g.inputs}
    line = ParkTimeline(g, range(len(g.ops)), "cpu:0", profile, "cpu:1", *[profile.link("cpu:0", "cpu:1")] * 2, homes)
    v = max(g.producer, key=lambda u: len(line.uses[u]))
    assert g.op[g.producer[v]].target == "aten.native_layer_norm.default" and len(line.uses[v]) == 8
    b = line.boundary
    drop = line.drop(v, 0, b, BIG, 0)
    assert drop is not None and drop.a < b < drop.b
    line.apply(drop)
    line.refresh()
    assert len(line.spans[v]) == 2
    late = line.park(v, 1, gap_inside(line, v, 1, backward=True), 0.0)
    assert late is not None and late.out
    line.apply_park(late)
    early = line.park(v, 0, gap_inside(line, v, 0, backward=False), 0.0)
    assert early is not None
    # the store holds v only from the backward residency on: the forward gap needs its own copy out
    assert early.out and early.a < late.a
    line.apply_park(early)
    return g, line_plan(g, profile, {"cpu:0": BIG}, homes, line, "graph", 0, 0.0), profile, v


def test_an_earlier_gap_parked_after_a_later_one_copies_out_once_for_both() -> None:
    g, plan, profile, v = later_gap_parked_first()
    assert_prediction_matches(g, plan, profile, {"cpu:0": BIG})
    moves = [s for s in plan.steps if isinstance(s, Copy) and s.value == v]
    assert [(s.src, s.dst) for s in moves] == [("cpu:0", "cpu:1"), ("cpu:1", "cpu:0"), ("cpu:1", "cpu:0")]
    assert redundant_copies(g, plan) == []


@pytest.mark.parametrize("overlap", [None, True])
def test_the_plan_trains_as_eager(overlap: bool | None) -> None:
    """Step by step (the reference runner) and on the executor's lanes: eager's loss and every gradient."""
    module, inputs, g, _ = chunked()
    _, plan, _, _ = later_gap_parked_first()
    model = copy.deepcopy(module)
    torch.manual_seed(7)  # the same dropout masks as the plan's run
    loss = model(*inputs)
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert_plan_trains_as_eager(g, plan, bind_inputs(g, module, inputs), [loss], grads, overlap)


def eager_loss_backward(model: torch.nn.Module, inputs: tuple) -> tuple[list[torch.Tensor], dict]:
    """Eager's logits and loss, and the gradients of `loss.backward()`, under seed 7 (the dropout masks the plan's
    run draws); the model's grads are cleared again."""
    torch.manual_seed(7)
    logits, loss = model(*inputs)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return [logits, loss], grads


def assert_plan_trains_as_eager(
    g: Graph, plan: Plan, env: dict, outputs: list[torch.Tensor], grads: dict, overlap: bool | None
) -> None:
    """`plan` run step by step (`overlap` None: the reference runner) or on the executor, under seed 7 as eager
    ran: eager's `outputs` in order, and every gradient to 1e-5 of its largest entry (a loss summed per block adds
    in another order)."""
    torch.manual_seed(7)
    if overlap is None:
        values = run_plan(g, plan, env)
    else:
        ex = Executor(g, plan, overlap=overlap)
        values = ex(env).outputs
        ex.close()
    got = unpack_outputs(g, values)
    assert len(got.outputs) == len(outputs)
    for have, want in zip(got.outputs, outputs):
        assert_close(have, want.detach(), rtol=1e-5, atol=1e-6)
    assert got.grads.keys() == grads.keys()
    for n, want in grads.items():
        atol = 1e-6 * max(1.0, float(want.abs().max()))
        assert_close(got.grads[n], want, rtol=1e-5, atol=atol, msg=lambda m, n=n: f"{n}: {m}")
