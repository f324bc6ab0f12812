"""Hugging Face models as people run them, through `wrap`: GPT-2, a grouped-query Llama, Qwen2, a BERT masked LM
and a BART encoder-decoder, with SDPA (the default) at 70% on one device and at 50% on cpu:0 + cpu:1, and with
eager attention at 50% on cpu:0 + cpu:1: losses, gradients and the parameters after 3 AdamW steps equal eager
PyTorch's (dropout on). Eager attention captures other ops (matmul, softmax, dropout), not another placement: its
one-device case would run the same plan paths as SDPA's."""

from __future__ import annotations

import copy

import pytest
import torch
from hf_models import HEAD_DIM, batches, build
from torch.testing import assert_close

from xsched import wrap

pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")

BUDGETS = {"one": {"cpu": "70%"}, "two": {"cpu:0": "50%", "cpu:1": "50%"}}


def train3(model: torch.nn.Module, call: torch.nn.Module, batch) -> tuple[list, list[dict]]:
    """3 AdamW steps of `call` (the model itself or its wrap), each from the same RNG state: losses and grads."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses, grads = [], []
    for step in range(3):
        torch.manual_seed(step)
        loss = call(*batch(step))
        loss.backward()
        losses.append(loss.detach())
        grads.append({k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None})
        opt.step()
        opt.zero_grad()
    return losses, grads


@pytest.mark.parametrize(
    "name,attn,where", [(n, a, w) for n in HEAD_DIM for a, w in (("sdpa", "one"), ("sdpa", "two"), ("eager", "two"))]
)
def test_hf_model_trains_like_eager(name: str, attn: str, where: str) -> None:
    torch.manual_seed(0)
    model = build(name, attn)
    ref = copy.deepcopy(model)
    batch = batches(name)
    wrapped = wrap(model, batch(0), BUDGETS[where], method="checkpoint", profile="model")
    assert wrapped.plan.solver.found_by == "checkpoint"
    got_loss, got_grads = train3(model, wrapped, batch)
    want_loss, want_grads = train3(ref, ref, batch)
    assert_close(torch.stack(got_loss), torch.stack(want_loss), rtol=1e-5, atol=1e-6)
    for got, want in zip(got_grads, want_grads):
        assert got.keys() == want.keys()
        assert_close(got, want, rtol=1e-4, atol=1e-6)
    assert_close(dict(model.named_parameters()), dict(ref.named_parameters()), rtol=1e-4, atol=1e-5)
