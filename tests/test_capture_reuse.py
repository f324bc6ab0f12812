"""captured_once(): a repeated capture of the same model and inputs returns the first graph; any change the key sees
(inputs, parameters, mode, options, autocast) traces again, each graph equal to a fresh capture outside the scope.
Likewise the fake forward that finds the model's outputs runs once for the loss's outputs, the capture and `wrap`."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from xsched.capture import torch as capture_torch
from xsched.capture.grad_outputs import loss_outputs
from xsched.capture.reuse import captured_once
from xsched.capture.torch import capture
from xsched.execute.wrap_signature import output_spec


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))


def _counting(monkeypatch) -> list[int]:
    calls: list[int] = []
    real = capture_torch._capture

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(capture_torch, "_capture", counted)
    return calls


def test_repeat_in_scope_reuses_the_graph_under_its_new_name(monkeypatch):
    model, x = _model(), torch.randn(4, 6)
    fresh = capture(model, (x,), name="first")
    calls = _counting(monkeypatch)
    with captured_once():
        a = capture(model, (x,), name="first")
        b = capture(model, (torch.randn(4, 6),), name="second")  # same shapes: the same graph
    assert len(calls) == 1
    assert a.fingerprint == b.fingerprint == fresh.fingerprint
    assert (a.name, b.name) == ("first", "second")
    capture(model, (x,))  # outside the scope: traced again
    assert len(calls) == 2


def test_what_the_key_sees_traces_again(monkeypatch):
    model, x = _model(), torch.randn(4, 6)
    calls = _counting(monkeypatch)
    with captured_once():
        base = capture(model, (x,))
        shape = capture(model, (torch.randn(5, 6),))
        infer = capture(model, (x,), inference=True)
        grads = capture(model, (x,), grad_outputs=[0])
        model[0].weight.requires_grad_(False)
        frozen = capture(model, (x,))
        model[0].weight.requires_grad_(True)
        model.eval()
        evaluated = capture(model, (x,))
        model.train()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            cast = capture(model, (x,))
        other = capture(_model(), (x,))
        again = capture(model, (x,))
    assert len(calls) == 8  # every capture but the last traced
    assert again is base
    monkeypatch.undo()
    assert shape.fingerprint == capture(model, (torch.randn(5, 6),)).fingerprint != base.fingerprint
    assert infer.fingerprint == capture(model, (x,), inference=True).fingerprint != base.fingerprint
    assert grads.fingerprint == base.fingerprint  # one output: the same graph, found by tracing again
    model.eval()
    assert evaluated.fingerprint == capture(model, (x,)).fingerprint != base.fingerprint  # the graph says its mode
    model.train()
    model[0].weight.requires_grad_(False)
    assert frozen.fingerprint == capture(model, (x,)).fingerprint != base.fingerprint
    model[0].weight.requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert cast.fingerprint == capture(model, (x,)).fingerprint != base.fingerprint
    assert other.fingerprint == base.fingerprint


def test_xsched_train_traces_the_model_once_and_trains_as_with_two_traces(monkeypatch, tmp_path):
    import contextlib

    from xsched.train import TrainConfig, train
    from xsched.train import session as train_session
    from xsched.train.records import Quiet

    def run(cache: str) -> list[float]:
        config = TrainConfig("zoo:gpt2", {"cpu": "100%"}, steps=2, scale="tiny", profile="model", cache_dir=cache)
        return list(train(config, Quiet()).losses)

    calls = _counting(monkeypatch)
    once = run(str(tmp_path / "once"))
    assert len(calls) == 1  # planned and wrapped from one trace
    monkeypatch.setattr(train_session, "captured_once", contextlib.nullcontext)
    twice = run(str(tmp_path / "twice"))
    assert len(calls) == 3  # without the scope, wrap traces the model again
    assert once == twice


class Counted(nn.Module):
    """forward(x, y) -> (logits, loss), counting its calls."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(6, 3)
        self.calls = 0

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.calls += 1
        logits = self.body(x)
        return logits, F.cross_entropy(logits, y)


def test_the_fake_forward_runs_once_for_the_loss_outputs_the_capture_and_wraps_output_structure():
    """Outside a scope each of the three runs its own fake forward (and the capture a fourth, its trace); within
    one, the first fake forward serves all three, with the results found outside."""
    model, inputs = Counted(), (torch.randn(4, 6), torch.randint(0, 3, (4,)))

    def found() -> tuple:
        losses = loss_outputs(model, inputs, lambda out, _: out[1] * 2, None)
        return losses, capture(model, inputs, grad_outputs="auto").fingerprint, output_spec(model, inputs)

    alone = found()
    assert model.calls == 4 and alone[0] == (1,) and alone[2][2] == [True, True]
    model.calls = 0
    with captured_once():
        assert found() == alone
    assert model.calls == 2  # one fake forward, one trace
    model.calls = 0
    with captured_once(), torch.autocast("cpu", dtype=torch.bfloat16):  # what the key sees: found again
        cast = found()
        torch.set_grad_enabled(False)
        try:
            no_grad = output_spec(model, inputs)
        finally:
            torch.set_grad_enabled(True)
    assert model.calls == 3 and no_grad[2] == [False, False] and cast[1] != alone[1]
