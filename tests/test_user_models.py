"""What a sweep of user-like models through `wrap` found, each fixed and held here against eager PyTorch: a forward
returning None beside a tensor (StopIteration), spectral norm's buffer that the step only overwrites (KeyError while
timing the eager step), and sparse gradients (an executor error on a sparse tensor's bytes, now a one-line capture
error). The LSTM, embedding bags, bf16 batch norm, autocast and keyword calls have their own tests."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.testing import assert_close

from xsched.capture import capture
from xsched.errors import CaptureError
from xsched.execute.back_to_back import graph_inputs, time_eager_step
from xsched.execute.wrap import wrap

pytestmark = pytest.mark.usefixtures("one_thread")


class NormedWithNone(nn.Module):
    """weight norm and spectral norm (parametrizations; spectral norm's power iteration overwrites its `_u` buffer
    without reading it), and a forward that returns `(logits, None)`."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.utils.parametrizations.weight_norm(nn.Linear(16, 16))
        self.o = nn.utils.parametrizations.spectral_norm(nn.Linear(16, 4))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        return self.o(F.silu(self.a(x))), None


def batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)


def test_a_buffer_no_op_reads_gets_an_input_for_the_timed_eager_step() -> None:
    model = NormedWithNone().train()
    graph = capture(model, (batch(0)[0],))
    unread = [v for v in graph.inputs if not graph.consumers.get(v)]
    assert unread == ["buffer:o.parametrizations.weight.0._u"]
    assert set(graph_inputs(graph, torch.device("cpu"))) == set(graph.inputs)
    assert time_eager_step(graph, "cpu", reps=1) > 0


def test_parametrized_layers_and_a_none_output_train_like_eager() -> None:
    """3 SGD steps: the same losses, parameters and power-iteration buffers; the None comes back as None."""
    eager = NormedWithNone().train()
    model = copy.deepcopy(eager)
    w = wrap(model, (batch(0)[0],), {"cpu": "100%"}, method="eager", profile="model")
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (w, eager)]
    for k in range(3):
        x, y = batch(k)
        for m, opt in zip((w, eager), opts, strict=True):
            logits, none = m(x)
            assert none is None
            opt.zero_grad()
            F.cross_entropy(logits, y).backward()
            opt.step()
    for (name, p), q in zip(eager.state_dict().items(), model.state_dict().values(), strict=True):
        assert_close(q, p, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")


def test_sparse_gradients_are_a_one_line_capture_error() -> None:
    class Bag(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.e, self.o = nn.Embedding(30, 8, sparse=True), nn.Linear(8, 4)

        def forward(self, i: torch.Tensor) -> torch.Tensor:
            return self.o(self.e(i).mean(1))

    with pytest.raises(CaptureError, match=r"Bag: .* makes a sparse_coo tensor; .*sparse=False") as e:
        capture(Bag(), (torch.randint(0, 30, (8, 5)),))
    assert "\n" not in str(e.value)
