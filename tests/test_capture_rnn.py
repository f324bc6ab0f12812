"""Recurrent layers: an LSTM's training graph is its per-step ops (oneDNN's fused layer sizes its workspace wrong
under fake tensors), profiled, planned and trained against eager PyTorch; inference on the CPU keeps the fused layer."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from executor_support import unit_profile
from torch import nn
from torch.testing import assert_close

from xsched.capture import capture
from xsched.contracts.plan import Compute
from xsched.execute.wrap import wrap
from xsched.profiling.measure import profile_graph

pytestmark = pytest.mark.usefixtures("one_thread")


class Recurrent(nn.Module):
    """Two stacked LSTM layers (one bidirectional) and a GRU, read at their last step."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(6, 8, num_layers=2, batch_first=True, bidirectional=True)
        self.gru = nn.GRU(16, 8, batch_first=True)
        self.head = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, _ = self.lstm(x)
        z, _ = self.gru(y)
        return self.head(z[:, -1])


def model() -> nn.Module:
    torch.manual_seed(0)
    return Recurrent().train()


def batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(16, 6, 6, generator=g), torch.randint(0, 5, (16,), generator=g)


def fused(graph) -> list[str]:
    return [op.target for op in graph.ops if "mkldnn" in op.target]


def test_training_graph_has_no_fused_rnn_layer_and_the_flag_is_restored() -> None:
    """The fused layer's fake workspace is 0 bytes where the real one is not (its backward read it and crashed the
    profiler): training and GPU graphs trace the LSTM per step; the global oneDNN flag is as it was."""
    before = torch.backends.mkldnn.enabled
    x = batch(0)[0]
    assert fused(capture(model(), (x,))) == []
    assert fused(capture(model(), (x,), device_type="cuda")) == []
    assert (
        fused(capture(model(), (x,), inference=True)) == ["aten.mkldnn_rnn_layer.default"] * 4
    )  # 2 layers, 2 directions
    assert torch.backends.mkldnn.enabled == before


def test_lstm_profiles_and_trains_like_eager_under_a_budget() -> None:
    """Every op measured on this CPU (the fused layer's backward read an empty workspace there and crashed the
    process); planned at 80% of eager's peak on unit costs (the plan must not depend on the machine), it
    recomputes, and 3 AdamW steps give eager's losses, parameters and gradients."""
    ref, mine = model(), model()
    graph = capture(mine, (batch(0)[0],))
    measured = profile_graph(graph, ["cpu"])
    assert all(measured.compute["cpu"].get(op.id) is not None for op in graph.ops)
    w = wrap(mine, (batch(0)[0],), {"cpu": "80%"}, method="checkpoint", profile=unit_profile(graph, ("cpu",)))
    assert sum(isinstance(s, Compute) for s in w.plan.steps) > len(graph.ops)  # it recomputes
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ref, w)]
    for k in range(3):
        x, y = batch(k)
        losses = []
        for m, opt in zip((ref, w), opts, strict=True):
            opt.zero_grad()
            loss = F.cross_entropy(m(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(ref.named_parameters(), mine.parameters(), strict=True):
        assert_close(q, p, rtol=1e-4, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")
        assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-5, msg=lambda m, name=name: f"grad {name}: {m}")


def test_lstm_inference_on_the_cpu_keeps_the_fused_layer_and_matches_eager() -> None:
    """No grad, eval mode: the plan runs oneDNN's fused layer, as eager does, and gives its outputs."""
    ref = model().eval()
    w = wrap(copy.deepcopy(ref), (batch(0)[0],), {"cpu": "100%"}, method="eager")
    with torch.no_grad():
        for k in range(2):
            x = batch(k)[0]
            assert_close(w(x), ref(x), rtol=1e-5, atol=1e-6)
