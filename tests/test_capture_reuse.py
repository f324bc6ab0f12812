"""captured_once(): a repeated capture of the same model and inputs returns the first graph; any change the key sees
(inputs, parameters, mode, options, autocast) traces again, each graph equal to a fresh capture outside the scope."""

from __future__ import annotations

import torch
from torch import nn

from xsched.capture import torch as capture_torch
from xsched.capture.reuse import captured_once
from xsched.capture.torch import capture


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
