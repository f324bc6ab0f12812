"""What a sweep of user-like models through `wrap` found, each fixed and held here against eager PyTorch: a forward
returning None beside a tensor (StopIteration), spectral norm's buffer that the step only overwrites (KeyError while
timing the eager step), and sparse gradients (an executor error on a sparse tensor's bytes, now a one-line capture
error). The LSTM, embedding bags, bf16 batch norm, autocast and keyword calls have their own tests."""

from __future__ import annotations

import copy
import dataclasses

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


def test_a_hugging_face_model_called_with_keywords_trains_like_eager() -> None:
    """`wrap(model, dict(batch))` and `wrapped(**batch)`, as Hugging Face code calls a model (input_ids,
    attention_mask, labels by name): BERT's ModelOutput and gradients equal eager's. Timing its eager step on
    random inputs failed: the token-type buffer, gathered by position and then looked up in a table of 2 rows,
    was drawn up to 63; integer buffers are zeros now."""
    pytest.importorskip("transformers")
    import hf_models

    torch.manual_seed(0)
    eager = hf_models.build("bert", "sdpa").model
    model = copy.deepcopy(eager)
    ids, labels = hf_models.batches("bert")(0)
    mask = torch.ones_like(ids)
    mask[:, -5:] = 0
    batch = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    graph = capture(model, (ids, mask, None, None, None, None, None, labels))
    assert time_eager_step(graph, "cpu", reps=1) > 0
    w = wrap(model, batch, {"cpu": "100%"}, method="eager", profile="model")
    for m in (w, eager):
        torch.manual_seed(9)  # the same dropout masks
        out = m(**batch)
        assert type(out).__name__ == "MaskedLMOutput"
        out.loss.backward()
    for (name, p), q in zip(eager.named_parameters(), model.parameters(), strict=True):
        assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")


def test_copying_or_pickling_a_wrapped_module_is_a_one_line_error_and_dtype_changes_replan() -> None:
    """`copy.deepcopy(wrapped)` (an EMA) and `torch.save(wrapped)` failed deep in the executor's queues and hooks:
    one line now says what to do instead. `.double()` after wrapping at 100% plans the float64 graph within its own
    eager peak (twice the bytes of the float32 one: the budget's bytes there are a floor, not a cap) and runs as
    eager does."""
    import io
    import pickle

    from xsched.errors import XschedError

    torch.manual_seed(0)
    eager = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))
    model = copy.deepcopy(eager)
    x = batch(0)[0]
    w = wrap(model, (x,), {"cpu": "100%"}, method="eager", profile="model")
    for copying in (lambda: copy.deepcopy(w), lambda: torch.save(w, io.BytesIO()), lambda: pickle.dumps(w)):
        with pytest.raises(XschedError, match="a wrapped module cannot be") as e:
            copying()
        assert "\n" not in str(e.value)
    w.double(), eager.double()
    assert_close(w(x.double()), eager(x.double()), rtol=1e-12, atol=1e-12)


def test_a_stored_profile_whose_left_out_op_runs_now_is_measured_again(tmp_path) -> None:
    """A profile saved while an op could not run (an older profiler's inputs, as embedding bags' offsets were) was
    reused as it was, so the model stayed unplannable after the fix until `profiles/` was deleted. Where that op
    runs now, `wrap`'s and `xsched train`'s stored profile is measured again; a profile without such ops is reused."""
    from functools import partial

    from xsched.devices.base import Policy
    from xsched.pipeline import measured_profile, profile_path
    from xsched.profiling.measure import profile_graph
    from xsched.profiling.store import save_profile

    measure = partial(profile_graph, policy=Policy().quick(), rounds=1, copy_sizes=(1 << 10,))
    graph = capture(nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 4)), (batch(0)[0],))
    fresh = measured_profile(graph, ["cpu"], tmp_path, measure=measure)
    path = profile_path(graph, ["cpu"], tmp_path)
    assert measured_profile(graph, ["cpu"], tmp_path, measure=measure) == fresh  # reused
    left_out = graph.ops[1].id
    costs = {o: c for o, c in fresh.compute["cpu"].items() if o != left_out}
    reason = {"cpu": {left_out: "XschedError: an older profiler's inputs were refused"}}
    stale = dataclasses.replace(fresh, compute={"cpu": costs}, extra={**fresh.extra, "unsupported": reason})
    save_profile(stale, path)
    again = measured_profile(graph, ["cpu"], tmp_path, measure=measure)
    assert left_out in again.compute["cpu"] and not again.extra.get("unsupported")
