"""capture(..., reuse_blocks=True): a model whose body is a list of identical blocks, traced cut to 3, 4 and 5 blocks
and extrapolated, gives exactly the full capture's graph (every op, value, role, the fingerprint): zoo GPT-2 and
Llama, a hand-built stack, train and inference, dropout, bf16; blocks that differ, or a forward that treats one
block apart, fall back to the full capture with a one-line notice."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from xsched.capture import torch as capture_torch
from xsched.capture.blocks import capture_blocks, extrapolate, repeated_blocks, with_blocks
from xsched.capture.periodic import Mismatch
from xsched.capture.torch import capture
from xsched.contracts.device_dtypes import typed_for
from xsched.loaders import load_training_task
from xsched.train.plan_wrap import grad_outputs


def _no_full():
    pytest.fail("fell back to the full capture")


def _reused(model: nn.Module, inputs: tuple, inference: bool = False, grads="all"):
    """The graph of the cut captures extrapolated, typed for the CPU as `capture` types it (a layer norm's
    statistics as the device makes them); fails the test if it falls back."""
    cut = lambda m: capture_torch._capture(m, inputs, inference, None, grads)  # noqa: E731
    return typed_for(capture_blocks(model, inputs, inference, cut, _no_full, least=6), "cpu")


def _assert_same(reused, full) -> None:
    assert len(reused.ops) == len(full.ops)
    for mine, theirs in zip(reused.ops, full.ops):
        assert mine == theirs
    assert reused.values == full.values
    assert reused == full
    assert reused.fingerprint == full.fingerprint


@pytest.mark.parametrize(
    ("name", "scale", "inference"),
    [
        ("gpt2", "tiny:n_layer=6,dropout=0.1", False),  # random ops, kept in eager order
        ("gpt2", "tiny:n_layer=6,dropout=0.0", True),
    ],
)
def test_zoo_models_extrapolate_to_the_full_capture(name, scale, inference):
    torch.manual_seed(0)
    task = load_training_task(f"zoo:{name}", None, scale, 0)
    inputs = tuple(task.example_batch[0])
    grads = "all" if inference else grad_outputs(task)
    full = capture(task.model, inputs, inference=inference, grad_outputs=grads)
    _assert_same(_reused(task.model, inputs, inference, grads), full)


def test_bf16_llama_under_the_runs_autocast():
    from xsched.train.optim import autocast

    task = load_training_task("zoo:llama", None, "tiny:n_layer=6", 0)
    task.model.to(torch.bfloat16)
    inputs = tuple(task.example_batch[0])
    with autocast("bf16", ("cuda",)):
        grads = grad_outputs(task)
        full = capture(task.model, inputs, grad_outputs=grads)
        _assert_same(_reused(task.model, inputs, False, grads), full)


class Block(nn.Module):
    def __init__(self, hidden: int, extra: bool = False) -> None:
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(8), nn.Linear(8, hidden), nn.Linear(hidden, 8)
        self.extra = extra

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x + self.down(F.gelu(self.up(self.norm(x))))
        return y * 2 if self.extra else y


class Stack(nn.Module):
    def __init__(self, widths: list[int], apart: int | None = None, checkpointed: int | None = None) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.blocks = nn.ModuleList(Block(w) for w in widths)  # each block's hidden width
        self.out = nn.Linear(8, 3)
        self.apart = apart  # the forward treats this block's output apart
        self.checkpointed = checkpointed  # from this block on, blocks run under activation checkpointing

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for i, b in enumerate(self.blocks):
            recomputed = self.checkpointed is not None and i >= self.checkpointed
            x = torch.utils.checkpoint.checkpoint(b, x, use_reentrant=False) if recomputed else b(x)
            if i == self.apart:
                x = torch.tanh(x)
        return self.out(x)


def _stack(**kw) -> tuple[nn.Module, tuple]:
    torch.manual_seed(0)
    return Stack(**kw), (torch.randn(5, 4),)


@pytest.mark.parametrize("inference", [False, True])
def test_a_stack_extrapolates_in_training_and_inference(inference):
    model, x = _stack(widths=[8] * 7)
    _assert_same(_reused(model, x, inference), capture(model, x, inference=inference))
    assert len(model.blocks) == 7  # the cuts were copies


def test_a_stack_under_cpu_autocast():
    model, x = _stack(widths=[8] * 7)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _assert_same(_reused(model, x), capture(model, x))


class NormBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.bn, self.drop = nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(torch.relu(self.bn(self.fc(x))))


class NormStack(nn.Module):
    """Buffers updated in every block, random ops, two outputs (one reads block 0 alone)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks, self.head = nn.Sequential(*(NormBlock() for _ in range(7))), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.head(self.blocks(x)).sum(), self.blocks[0].fc.weight.sum()


def test_buffer_updates_and_an_input_gradient_extrapolate():
    torch.manual_seed(0)
    model, x = NormStack(), (torch.randn(5, 8, requires_grad=True),)
    full = capture(model, x)
    assert len(full.buffer_updates) == 21 and list(full.input_grads) == [0]
    _assert_same(_reused(model, x), full)
    model.eval()  # block 0's input needs a gradient, the others' not (no_grad): the check skips block 0
    _assert_same(_reused(model, x, inference=True), capture(model, x, inference=True))


def test_the_public_option_traces_three_cuts_not_the_model(monkeypatch):
    model, x = _stack(widths=[8] * 16)
    full = capture(model, x)
    traced: list[int] = []
    real = capture_torch._capture
    monkeypatch.setattr(capture_torch, "_capture", lambda m, *a: traced.append(len(m.blocks)) or real(m, *a))
    _assert_same(capture(model, x, reuse_blocks=True), full)
    assert traced == [3, 4, 5]


def test_the_loss_outputs_fake_forward_serves_the_block_check(monkeypatch):
    from xsched.capture import blocks
    from xsched.capture.block_ops import block_ops
    from xsched.capture.grad_outputs import loss_outputs
    from xsched.capture.reuse import captured_once, recall

    model, x = _stack(widths=[8] * 16)
    full = capture(model, x)
    with captured_once():
        loss_outputs(model, x, lambda out, y: F.mse_loss(out, y), torch.zeros(5, 3))
        kept = recall(blocks._CALLS, model, x)
        assert kept == block_ops(model, model.blocks, x, False)  # the check's own fake forward sees the same calls
        monkeypatch.setattr(blocks, "block_ops", lambda *a: pytest.fail("ran its own fake forward"))
        _assert_same(capture(model, x, reuse_blocks=True), full)


def test_a_cut_shares_the_models_parameters_and_leaves_it_whole():
    model, _ = _stack(widths=[8] * 6)
    cut = with_blocks(model, "blocks", 2)
    assert len(cut.blocks) == 2 and len(model.blocks) == 6
    assert cut.blocks[1] is model.blocks[1] and cut.inp is model.inp
    assert repeated_blocks(model) == ("blocks", 6)


def test_wrap_runs_the_extrapolated_graph_as_eager_pytorch_does(monkeypatch):
    import copy

    from xsched.execute.wrap import wrap

    model, x = _stack(widths=[8] * 16)
    eager = copy.deepcopy(model)
    traced: list[int] = []
    real = capture_torch._capture
    monkeypatch.setattr(capture_torch, "_capture", lambda m, *a: traced.append(len(m.blocks)) or real(m, *a))
    wrapped = wrap(model, x, {"cpu": "100%"}, method="eager", profile="model")
    out, ref = wrapped(*x), eager(*x)
    (out * out).sum().backward()
    (ref * ref).sum().backward()
    assert traced == [3, 4, 5]  # wrap's capture went through the cuts
    torch.testing.assert_close(out, ref)
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


def test_too_few_blocks_to_pay_are_traced_whole(monkeypatch):
    model, x = _stack(widths=[8] * 15)
    traced: list[int] = []
    real = capture_torch._capture
    monkeypatch.setattr(capture_torch, "_capture", lambda m, *a: traced.append(len(m.blocks)) or real(m, *a))
    capture(model, x, reuse_blocks=True)
    assert traced == [15]


def test_a_backward_hook_on_one_block_breaks_the_repeat():
    model, _ = _stack(widths=[8] * 16)
    model.blocks[12].register_full_backward_hook(lambda *a: None)
    assert repeated_blocks(model) is None


def _falls_back(model, x, capsys) -> str:
    full = capture(model, x)
    _assert_same(capture(model, x, reuse_blocks=True), full)
    return capsys.readouterr().err


def test_blocks_of_other_widths_are_not_a_repeated_list(capsys):
    model, x = _stack(widths=[8] * 8 + [12] * 8)
    assert repeated_blocks(model) is None
    assert _falls_back(model, x, capsys) == ""


@pytest.mark.parametrize("which", [3, 15])  # inside the cuts (blocks 0-4), and beyond them
def test_a_block_with_an_extra_op_falls_back(which, capsys):
    model, x = _stack(widths=[8] * 16)
    model.blocks[which].extra = True
    assert f"block {which} (or the model right after it) runs other ops than block 1" in _falls_back(model, x, capsys)


@pytest.mark.parametrize("apart", [2, 9])
def test_a_forward_that_treats_one_block_apart_falls_back(apart, capsys):
    model, x = _stack(widths=[8] * 16, apart=apart)
    err = _falls_back(model, x, capsys)
    assert err.startswith("xsched: capturing every block of blocks:") and len(err.splitlines()) == 1
    assert f"block {apart} (or the model right after it)" in err


def test_blocks_checkpointed_beyond_the_cuts_fall_back(capsys):
    model, x = _stack(widths=[8] * 16, checkpointed=10)
    assert "block 10 (or the model right after it)" in _falls_back(model, x, capsys)


def test_the_check_graph_must_be_predicted_exactly():
    model, x = _stack(widths=[8] * 7)
    g = [capture(with_blocks(model, "blocks", n), x) for n in (3, 4, 5, 6)]
    assert extrapolate(g[0], g[1], g[2], 3) == g[3]
    with pytest.raises(Mismatch, match="predict the next one wrongly"):
        extrapolate(g[0], g[1], g[3], 3)  # "the next one" is two blocks on
    with pytest.raises(Mismatch):
        extrapolate(g[0], g[2], g[3], 3)  # two blocks apart, read as one
