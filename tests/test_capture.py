"""PyTorch capture: joint graph structure, phases, folding of views, determinism, JSON, and clear capture errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from xsched.capture import bind_inputs, capture, unpack_outputs
from xsched.capture.fxgraph import is_view
from xsched.contracts.graph import Graph
from xsched.contracts.torch_ops import resolve, run_op
from xsched.errors import CaptureError


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 16)
        self.drop = nn.Dropout(0.5)
        self.fc2 = nn.Linear(16, 3)

    def forward(self, x):
        return self.fc2(self.drop(torch.relu(self.fc1(x))))


class ConvBN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.head = nn.Linear(4, 2)
        self.loss = nn.MSELoss()

    def forward(self, x, y):
        h = F.max_pool2d(F.relu(self.bn(self.conv(x))), 2).mean((2, 3))
        return self.loss(self.head(h), y)


class ViewOut(nn.Module):
    """Returns views of intermediates: a transposed half of a split and a flattened tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 6)

    def forward(self, x):
        y = self.fc(x)
        a, _ = y.split(3, dim=1)
        return a.t(), y.view(-1)


class TwoOut(nn.Module):
    """Two outputs, one of them integer (no tangent for it)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(5, 4)

    def forward(self, x):
        h = self.fc(x)
        return h.tanh(), h.argmax(-1)


class Emb(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.proj = nn.Linear(8, 10)

    def forward(self, idx, tgt):
        h = self.proj(F.dropout(self.emb(idx), 0.3, self.training))
        return F.cross_entropy(h.view(-1, 10), tgt.view(-1))


class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        y = self.fc(x)
        if y.sum() > 0:  # MARK: data-dependent branch
            return y * 2
        return y


class Wrapper(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 4), Branchy())

    def forward(self, x):
        return self.body(x)


class Masked(nn.Module):
    def forward(self, x):
        return x[x > 0].sum()  # MARK: boolean mask


class MutatesInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        x.add_(1)
        return self.fc(x)


class ReshapesInput(nn.Module):
    def forward(self, x):
        x.unsqueeze_(0)
        return x.sum()


class ComplexOut(nn.Module):
    def forward(self, x):
        return torch.fft.fft(x)


def _line(marker: str) -> int:
    lines = Path(__file__).read_text().splitlines()
    return next(i + 1 for i, s in enumerate(lines) if f"# MARK: {marker}" in s)


CASES = {
    "mlp": (MLP, lambda: (torch.randn(8, 6),)),
    "convbn": (ConvBN, lambda: (torch.randn(2, 3, 8, 8), torch.randn(2, 2))),
    "viewout": (ViewOut, lambda: (torch.randn(2, 4),)),
    "twoout": (TwoOut, lambda: (torch.randn(3, 5),)),
    "emb": (Emb, lambda: (torch.randint(0, 10, (2, 5)), torch.randint(0, 10, (2, 5)))),
}


def _capture(case: str) -> tuple[nn.Module, tuple, Graph]:
    torch.manual_seed(0)
    cls, make = CASES[case]
    model, inputs = cls(), make()
    return model, inputs, capture(model, inputs)


@pytest.mark.parametrize("case", sorted(CASES))
def test_graph_structure(case):
    model, inputs, g = _capture(case)
    phases = [o.phase for o in g.ops]
    assert "bwd" in phases and phases[0] != "bwd"
    first_bwd = phases.index("bwd")
    assert all(p == "bwd" for p in phases[first_bwd:]), "fwd/loss ops must come before every bwd op"
    for o in g.ops:  # views are folded into refs: no op is a view and every op can run
        assert not is_view(resolve(o.target)), o.target
        assert o.call is not None and len(o.call["outs"]) == len(o.outputs)
    params = {v.name: v for v in g.values if v.kind == "param"}
    assert set(params) == {k for k, _ in model.named_parameters()}
    grads = {g.value[v].grad_of for v in g.outputs if g.value[v].grad_of}
    assert grads == {v.id for v in params.values()}
    for v in g.values:
        if v.shape is not None:
            elem = torch.empty((), dtype=getattr(torch, v.dtype)).element_size()
            assert v.nbytes == torch.Size(v.shape).numel() * elem
    n_out = len(g.forward_outputs)
    tangents = [v for v in g.values if v.kind == "tangent"]
    assert len(tangents) == (1 if case == "twoout" else n_out)  # argmax output has no tangent


@pytest.mark.parametrize("case", ["mlp", "convbn", "viewout"])
def test_no_value_aliases_another(case):
    """Run every op once; no two live values may share storage (views are folded into their base)."""
    model, inputs, g = _capture(case)
    env = bind_inputs(g, model, inputs)
    store = {v: t.clone() for v, t in env.items()}
    for o in g.ops:
        store.update(zip(o.outputs, run_op(o, store)))
    ptrs = [t.untyped_storage().data_ptr() for t in store.values() if t.numel()]
    assert len(ptrs) == len(set(ptrs))


def test_buffers_tangents_and_names():
    model, inputs, g = _capture("convbn")
    kinds = {v.id: v.kind for v in g.values}
    assert [v for v in g.inputs if kinds[v] == "input"] == ["input:0", "input:1"]
    assert [v for v in g.inputs if kinds[v] == "tangent"] == ["tangent:0"]
    updates = {g.value[v].updates for v in g.outputs if g.value[v].updates}
    assert updates == {f"buffer:bn.{b}" for b in ("running_mean", "running_var", "num_batches_tracked")}
    assert set(g.buffer_updates) == {"bn.running_mean", "bn.running_var", "bn.num_batches_tracked"}
    assert {o.name for o in g.ops if o.phase != "bwd"} >= {"conv", "bn", "head", "loss"}
    loss_ops = [o for o in g.ops if o.phase == "loss"]
    assert loss_ops and all(o.name == "loss" for o in loss_ops)


def test_functional_loss_is_loss_phase():
    _, _, g = _capture("emb")
    loss = [o.target for o in g.ops if o.phase == "loss"]
    assert "aten.nll_loss_forward.default" in loss
    assert all(o.phase == "fwd" for o in g.ops if o.target == "aten.embedding.default")


def test_view_outputs_are_refs_with_view_chains():
    model, inputs, g = _capture("viewout")
    refs = g.forward_outputs
    assert all("view" in r for r in refs) and refs[0]["ref"] == refs[1]["ref"]
    assert len(g.outputs) == len(set(g.outputs))
    env = bind_inputs(g, model, inputs)
    store = dict(env)
    for o in g.ops:
        store.update(zip(o.outputs, run_op(o, store)))
    out = unpack_outputs(g, store)
    want = model(*inputs)
    assert all(torch.equal(a, b) for a, b in zip(out.outputs, want))


def test_json_round_trip_and_deterministic_fingerprint(tmp_path):
    model, inputs, g = _capture("convbn")
    g.save(tmp_path / "g.json")
    back = Graph.load(tmp_path / "g.json")
    assert back.fingerprint == g.fingerprint and back.to_dict() == g.to_dict()
    rng = torch.get_rng_state()
    assert capture(model, inputs).fingerprint == g.fingerprint  # same model: same ids, same fingerprint
    assert torch.equal(torch.get_rng_state(), rng)  # capture runs on fake tensors: the RNG does not move


def test_inference_mode_has_no_backward():
    model, inputs, _ = _capture("convbn")
    model.eval()
    g = capture(model, inputs, inference=True)
    assert {o.phase for o in g.ops} == {"fwd"}
    assert not [v for v in g.values if v.kind == "tangent" or v.grad_of]
    assert not g.buffer_updates  # eval-mode BN leaves the running stats alone
    store = dict(bind_inputs(g, model, inputs))
    for o in g.ops:
        store.update(zip(o.outputs, run_op(o, store)))
    with torch.no_grad():
        assert torch.equal(unpack_outputs(g, store).outputs[0], model(*inputs))


def test_data_dependent_branch_names_file_line_and_module():
    with pytest.raises(CaptureError) as e:
        capture(Wrapper(), (torch.randn(2, 4),))
    msg = str(e.value)
    assert f"{Path(__file__).name}:{_line('data-dependent branch')}" in msg
    assert "module body.1" in msg and "data-dependent" in msg and e.value.stage == "capture"
    assert "Traceback" not in msg


def test_boolean_mask_is_data_dependent():
    with pytest.raises(CaptureError, match=f"{Path(__file__).name}:{_line('boolean mask')}"):
        capture(Masked(), (torch.randn(3, 4),))


def test_unsupported_models_are_capture_errors():
    with pytest.raises(CaptureError, match="mutates input input:0 in place"):
        capture(MutatesInput(), (torch.randn(2, 4),))
    with pytest.raises(CaptureError, match="changes the shape or strides of an input"):
        capture(ReshapesInput(), (torch.randn(2, 4),))
    with pytest.raises(CaptureError, match="complex"):
        capture(ComplexOut(), (torch.randn(2, 4),))
    with pytest.raises(CaptureError, match="nn.Module"):
        capture(lambda x: x, (torch.randn(2),))


def test_bind_inputs_checks_shapes_and_tangent_count():
    model, inputs, g = _capture("mlp")
    with pytest.raises(CaptureError, match="shape"):
        bind_inputs(g, model, (torch.randn(3, 6),))
    with pytest.raises(CaptureError, match="tangents"):
        bind_inputs(g, model, inputs, (torch.ones(8, 3), torch.ones(8, 3)))
    env = bind_inputs(g, model, inputs)
    assert torch.equal(env["tangent:0"], torch.ones(8, 3))  # default: ones, like loss.backward()


def test_frozen_params_and_inputs_that_require_grad():
    torch.manual_seed(0)
    model = MLP().eval()  # eval: no dropout, so eager and the graph agree without seeding
    model.fc1.weight.requires_grad_(False)
    x = torch.randn(8, 6, requires_grad=True)
    g = capture(model, (x,))
    grad_of = {g.value[v].grad_of for v in g.outputs if g.value[v].grad_of}
    assert grad_of == {"param:fc1.bias", "param:fc2.weight", "param:fc2.bias", "input:0"}
    assert g.extra["inputs_requiring_grad"] == ["input:0"]
    store = dict(bind_inputs(g, model, (x,)))
    for o in g.ops:
        store.update(zip(o.outputs, run_op(o, store)))
    got = unpack_outputs(g, store)
    model(x).backward(torch.ones(8, 3))
    assert torch.equal(got.input_grads[0], x.grad)
    assert "fc1.weight" not in got.grads and torch.equal(got.grads["fc2.weight"], model.fc2.weight.grad)


class Checkpointed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 8)
        self.b = nn.Linear(8, 4)

    def forward(self, x):
        inner = lambda t: self.b(torch.relu(self.a(t)))  # noqa: E731
        return torch.utils.checkpoint.checkpoint(inner, x, use_reentrant=False).sum()


def test_activation_checkpointing_recomputes_in_backward():
    torch.manual_seed(0)
    model, x = Checkpointed(), torch.randn(3, 4)
    g = capture(model, (x,))
    fwd = [o.target for o in g.ops if o.phase != "bwd"]
    bwd = [o.target for o in g.ops if o.phase == "bwd"]
    assert fwd.count("aten.addmm.default") == 2 and "aten.addmm.default" in bwd  # the re-run forward
    store = dict(bind_inputs(g, model, (x,)))
    for o in g.ops:
        store.update(zip(o.outputs, run_op(o, store)))
    model(x).backward()
    got = unpack_outputs(g, store).grads
    assert all(torch.equal(got[k], p.grad) for k, p in model.named_parameters())
