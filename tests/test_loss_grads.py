"""Capture's grad_outputs: a model returning (logits, loss), trained by `loss.backward()`, is captured without a
gradient input for its logits or the backward ops it feeds; its plans run as eager's `loss.backward()` does (outputs,
gradients, buffers), on one logical CPU and on two; a gradient reaching a left-out output is a clear error."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.testing import assert_close

from xsched import zoo
from xsched.capture.grad_outputs import loss_outputs
from xsched.capture.torch import bind_inputs, capture, unpack_outputs
from xsched.contracts.plan import Compute, Copy
from xsched.errors import CaptureError, XschedError
from xsched.execute.reference import run_plan
from xsched.execute.wrap import wrap
from xsched.loaders import load_training_task
from xsched.pipeline import solve_plan
from xsched.train.plan_wrap import grad_outputs

pytestmark = pytest.mark.usefixtures("one_thread")


class LossModel(nn.Module):
    """(logits, loss) as Hugging Face models return them; batch norm (buffers) and dropout (random masks replayed
    by a recompute) in its blocks."""

    def __init__(self, width: int = 64, vocab: int = 32, depth: int = 4) -> None:
        super().__init__()
        torch.manual_seed(0)
        blocks = [m for _ in range(depth) for m in (nn.Linear(width, width), nn.BatchNorm1d(width), nn.ReLU())]
        self.body = nn.Sequential(*blocks, nn.Dropout(0.2))
        self.head = nn.Linear(width, vocab)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.head(self.body(x))
        return logits, nn.functional.cross_entropy(logits, y)


def batch(seed: int = 1, n: int = 512, width: int = 64, vocab: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, width, generator=g), torch.randint(0, vocab, (n,), generator=g)


def tangents(graph) -> list[str]:
    return [graph.value[v].name for v in graph.inputs if graph.value[v].kind == "tangent"]


def test_a_loss_only_graph_has_no_logits_tangent() -> None:
    """ "auto" (and the loss's position) captures the loss's backward alone: no logits-sized gradient input, fewer
    backward ops; "all" (capture's default) keeps the graph it always made."""
    model, inputs = LossModel(), batch()
    every, loss_only, named = (capture(model, inputs, grad_outputs=s) for s in ("all", "auto", [1]))
    assert tangents(every) == ["tangent:0", "tangent:1"] and tangents(loss_only) == ["tangent:1"]
    assert named.fingerprint == loss_only.fingerprint != every.fingerprint
    logits = 512 * 32 * 4
    homed = [sum(g.value[v].nbytes for v in g.inputs) for g in (every, loss_only)]
    assert homed[0] - homed[1] == logits
    bwd = [sum(o.phase == "bwd" for o in g.ops) for g in (every, loss_only)]
    assert bwd[1] < bwd[0]  # the sum of the logits' two gradients is gone
    fed = [o for o in loss_only.ops for v in o.inputs if loss_only.value[v].kind == "tangent"]
    assert fed and all(loss_only.value[v].name != "tangent:0" for o in fed for v in o.inputs)
    assert [o.id for o in loss_only.ops if o.phase != "bwd"] == [o.id for o in every.ops if o.phase != "bwd"]


def test_bad_grad_outputs_are_one_line_errors() -> None:
    model, inputs = LossModel(), batch()
    for bad, says in (([2], "returns 2 tensors"), ([], "names no output"), ("loss", "must be 'all', 'auto'")):
        with pytest.raises(CaptureError, match=says) as e:
            capture(model, inputs, grad_outputs=bad)
        assert "\n" not in str(e.value)


def test_the_train_command_differentiates_what_its_loss_reads() -> None:
    """`xsched train` captures the outputs its loss function reads: GPT-2's own loss of its (logits, loss), a
    classifier's logits; a loss that fake tensors cannot run (a branch on a value) keeps every output."""
    gpt2 = load_training_task("zoo:gpt2", scale="tiny")
    assert grad_outputs(gpt2) == (1,)
    assert grad_outputs(load_training_task("zoo:resnet18", scale="tiny")) == (0,)
    model, (x, y) = LossModel(), batch()
    assert loss_outputs(model, (x, y), lambda out, t: out[0].logsumexp(1).mean(), None) == (0,)
    assert loss_outputs(model, (x, y), lambda out, t: out[1] * float(out[1].detach()), None) is None


def eager_step(model: nn.Module, inputs: tuple, loss_of) -> tuple[torch.Tensor, ...]:
    torch.manual_seed(7)
    outs = model(*inputs)
    loss_of(outs).backward()
    return tuple(o.detach() for o in outs)


def assert_same(a: nn.Module, b: nn.Module, grads: bool = True) -> None:
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert_close(
            p.grad if grads else p, q.grad if grads else q, rtol=1e-5, atol=1e-6, msg=lambda m, n=n: f"{n}: {m}"
        )
    for (n, p), (_, q) in zip(a.named_buffers(), b.named_buffers()):
        assert_close(p, q, rtol=1e-5, atol=1e-6, msg=lambda m, n=n: f"buffer {n}: {m}")


@pytest.mark.parametrize("budgets", [{"cpu:0": "60%"}, {"cpu:0": "50%", "cpu:1": "100%"}], ids=["one", "two"])
def test_plans_run_as_eager_loss_backward(budgets: dict) -> None:
    """wrap's default captures the loss alone; below the eager peak (recomputes; copies to cpu:1 where it has
    one) two steps' outputs, gradients, buffers and SGD updates equal eager's."""
    eager = LossModel()
    model = copy.deepcopy(eager)
    w = wrap(model, batch(), budgets, method="checkpoint" if len(budgets) == 1 else "greedy", profile="model")
    assert tangents(w.graph) == ["tangent:1"]
    steps = w.plan.steps
    assert sum(isinstance(s, Compute) for s in steps) > len(w.graph.ops) or any(isinstance(s, Copy) for s in steps)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (w, eager)]
    for k in range(2):
        for opt in opts:
            opt.zero_grad()
        got, want = (eager_step(m, batch(seed=k), lambda out: out[1]) for m in (w, eager))
        for a, b in zip(got, want):
            assert_close(a, b, rtol=1e-5, atol=1e-6)
        assert_same(model, eager)
        for opt in opts:
            opt.step()
    assert_same(model, eager, grads=False)


def test_the_interpreted_loss_only_graph_is_eager_loss_backward() -> None:
    """The graph run by the reference interpreter (ones for its one tangent, as `loss.backward()` seeds) gives
    eager's outputs, gradients and new running statistics."""
    eager, model = LossModel(), LossModel()
    inputs = batch()
    g = capture(model, inputs, grad_outputs="auto")
    plan = solve_plan(g, {"cpu": "50%"}, method="checkpoint", profile="model")
    torch.manual_seed(7)
    got = unpack_outputs(g, run_plan(g, plan, bind_inputs(g, model, inputs)))
    want = eager_step(eager, inputs, lambda out: out[1])
    for a, b in zip(got.outputs, want):
        assert_close(a, b, rtol=1e-5, atol=1e-6)
    for n, p in eager.named_parameters():
        assert_close(got.grads[n], p.grad, rtol=1e-5, atol=1e-6)
    for n, b in eager.named_buffers():
        assert_close(got.buffers.get(n, b), b, rtol=1e-5, atol=1e-6)


def test_a_gradient_for_a_left_out_output_is_a_clear_error() -> None:
    """A loss that reads the logits too: wrap's default (the loss alone) names the output and the fix in one line;
    grad_outputs="all" trains it as eager does."""
    extra = lambda out: out[1] + out[0].square().mean()  # noqa: E731
    w = wrap(LossModel(), batch(), {"cpu": "100%"}, method="eager", profile="model")
    with pytest.raises(XschedError, match=r"forward output 0 \(float32 \[512, 32\]\).*grad_outputs='all'") as e:
        extra(w(*batch())).backward()
    assert "\n" not in str(e.value)
    eager = LossModel()
    model = copy.deepcopy(eager)
    w = wrap(model, batch(), {"cpu": "100%"}, method="eager", profile="model", grad_outputs="all")
    for m in (w, eager):
        eager_step(m, batch(), extra)
    assert_same(model, eager)


def test_a_plan_made_for_every_output_still_runs() -> None:
    """A plan solved on capture's default graph (as `xsched capture` writes it) is run by wrap as made, and a
    loss-only backward through it is eager's."""
    eager = LossModel()
    model = copy.deepcopy(eager)
    g = capture(model, batch())
    plan = solve_plan(g, {"cpu": "100%"}, method="eager", profile="model")
    w = wrap(model, batch(), {"cpu": "100%"}, plan=plan)
    assert w.graph.fingerprint == g.fingerprint
    for m in (w, eager):
        eager_step(m, batch(), lambda out: out[1])
    assert_same(model, eager)


def test_zoo_gpt2_loss_only_keeps_its_forward() -> None:
    """The zoo's GPT-2 (logits, loss): the same forward ops, the loss's backward alone."""
    z = zoo.build("gpt2", scale="tiny")
    every, loss_only = (capture(z.model, z.inputs, grad_outputs=s) for s in ("all", "auto"))
    assert tangents(loss_only) == ["tangent:1"]
    assert len(loss_only.ops) < len(every.ops)
    assert {o.target for o in loss_only.ops if o.phase != "bwd"} == {o.target for o in every.ops if o.phase != "bwd"}


def test_the_capture_command_takes_grad_outputs(tmp_path, capsys) -> None:
    """`xsched capture --grad-outputs auto` writes the loss-only graph; a position the model lacks is one line."""
    from xsched.cli import main
    from xsched.contracts.graph import Graph

    out = tmp_path / "g.json"
    assert main(["capture", "zoo:gpt2", "--scale", "tiny", "--grad-outputs", "auto", "-o", str(out)]) == 0
    assert tangents(Graph.load(out)) == ["tangent:1"]
    capsys.readouterr()
    assert main(["capture", "zoo:gpt2", "--scale", "tiny", "--grad-outputs", "0,5", "-o", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert "grad_outputs names output 5" in err and "\n" not in err
