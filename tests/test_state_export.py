"""Saving and loading a model trained with its weights in shared buffers (HostAdamW's packed buckets, pinned slabs)
as PyTorch and Hugging Face users do: torch.save of its state_dict into a fresh model, safetensors, save_pretrained
and from_pretrained, and load_state_dict into the trained model to resume; each against the eager model's
state_dict and eager AdamW, with the bytes copied at save time counted (none) and the files' sizes bounded."""

from __future__ import annotations

import pytest
import torch
from test_host_pinning import pins  # noqa: F401  (the fixture: pinning faked and counted on the CPU)
from torch import nn
from torch.testing import assert_close
from torch.utils._python_dispatch import TorchDispatchMode
from train_support import adamw, weight_decays

from xsched import zoo
from xsched.errors import XschedError
from xsched.execute import wrap
from xsched.train.host_adamw import HostAdamW

pytestmark = pytest.mark.usefixtures("one_thread")
LR = 1e-2
FILE_SLACK = 1024  # bytes a file may hold per entry beyond the tensors' own (names, headers, alignment)


class Copies(TorchDispatchMode):
    """The bytes torch copies (clone, copy_, a copying .to) while it is on: a save's extra host memory."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        if func in (torch.ops.aten.clone.default, torch.ops.aten._to_copy.default):
            self.bytes += out.numel() * out.element_size()
        elif func is torch.ops.aten.copy_.default:
            self.bytes += args[0].numel() * args[0].element_size()
        return out


def _gpt2() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """Zoo GPT-2 tiny (its embedding and head tied), the same weights each call, its dropout off (the eager
    reference draws other masks); it returns (logits, loss)."""
    z = zoo.build("gpt2", scale="tiny")
    for m in z.model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
    return z.model, tuple(z.inputs)


def _eager_adamw(model: nn.Module) -> torch.optim.AdamW:
    """torch's fused AdamW with the decays `weight_decays` gives: what HostAdamW runs, per parameter."""
    return adamw(model, lr=LR, fused=True)


def _on_host(model: nn.Module, inputs: tuple, *, pin: bool = False, delayed: bool = False):  # noqa: ANN202
    """`model` wrapped with its parameters on cpu:1 and HostAdamW over them in small buckets (lone and packed
    segments both), listening."""
    w = wrap(model, inputs, {"cpu:0": "100%"}, store="cpu:1", method="offload", profile="model", param_home="cpu:1")
    named = dict(model.named_parameters())
    host = HostAdamW(
        [(n, named[n]) for n in w.release_order], weight_decays(model), LR, bucket_bytes=5000, pin=pin, delayed=delayed
    )
    w.listen(host)
    assert {len(seg.params) > 1 for b in host.buckets for seg in b.segments} == {True, False}
    return w, host


def _loss(out):  # noqa: ANN001, ANN202
    return out[1] if isinstance(out, tuple) else out


def _step(w: nn.Module, host: HostAdamW, inputs: tuple) -> None:
    host.begin(True, True, LR)
    _loss(w(*inputs)).backward()
    host.end_backward()
    host.settle()


def _eager_step(model: nn.Module, opt: torch.optim.Optimizer, inputs: tuple) -> None:
    opt.zero_grad()
    _loss(model(*inputs)).backward()
    opt.step()


def _close(w, host: HostAdamW) -> None:  # noqa: ANN001
    w.listen(None)
    host.close()


def _unique_bytes(state: dict[str, torch.Tensor]) -> int:
    """The bytes of the state's tensors, each memory region once (tied weights once)."""
    regions = {(t.data_ptr(), t.numel() * t.element_size()) for t in state.values()}
    return sum(n for _, n in regions)


def _assert_views_of_buckets(host: HostAdamW) -> None:
    for b in host.buckets:
        for seg in b.segments:
            for p, (off, _) in zip(seg.params, seg.spans):
                assert p.data_ptr() == seg.compute.data_ptr() + off * p.element_size()


def _assert_each_entry_is_its_weight(state: dict[str, torch.Tensor], model: nn.Module) -> None:
    """Every entry is its parameter's or buffer's memory (nothing copied) over a storage of exactly its bytes."""
    live = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers(remove_duplicate=False))
    for name, t in state.items():
        assert t.data_ptr() == live[name].data_ptr(), name
        assert t.untyped_storage().nbytes() == t.numel() * t.element_size(), name


def test_torch_save_of_the_trained_model_writes_each_weight_once_and_loads_into_a_fresh_model(tmp_path) -> None:
    """After two steps (equal to eager AdamW's), the state_dict has the eager model's keys and values, each entry
    its weight's memory (the tied embedding and head one tensor, as eager); nothing is copied at save time, the
    file holds each weight's bytes once, and a fresh model loads it back exactly."""
    model, inputs = _gpt2()
    ref, _ = _gpt2()
    opt = _eager_adamw(ref)
    w, host = _on_host(model, inputs)
    try:
        for _ in range(2):
            _step(w, host, inputs)
            _eager_step(ref, opt, inputs)
        copies = Copies()
        with copies:
            state = model.state_dict()
            torch.save(state, tmp_path / "model.pt")
        assert copies.bytes == 0
        eager = ref.state_dict()
        assert list(state) == list(eager)
        for name, t in state.items():
            assert_close(t, eager[name], rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
        _assert_each_entry_is_its_weight(state, model)
        assert state["lm_head.weight"] is state["wte.weight"]
        assert (tmp_path / "model.pt").stat().st_size < _unique_bytes(state) + FILE_SLACK * len(state)
        fresh, _ = _gpt2()
        fresh.load_state_dict(torch.load(tmp_path / "model.pt"))
        for name, t in fresh.state_dict().items():
            assert torch.equal(t, state[name]), name
        assert fresh.lm_head.weight is fresh.wte.weight
    finally:
        _close(w, host)


def test_safetensors_takes_the_trained_state_dict_as_it_takes_the_eager_models(tmp_path) -> None:
    """save_file refuses the trained state_dict for its tied pair only, exactly as it refuses the eager model's;
    without the head (or through save_model, which drops tied names) it saves each weight once, copying nothing,
    and load_file / load_model give the trained values back."""
    from safetensors.torch import load_file, load_model, save_file, save_model

    model, inputs = _gpt2()
    eager, _ = _gpt2()
    w, host = _on_host(model, inputs)
    try:
        _step(w, host, inputs)
        refused = []
        for state in (model.state_dict(), eager.state_dict()):
            with pytest.raises(RuntimeError, match="share memory") as e:
                save_file(state, tmp_path / "refused.safetensors")
            refused.append(str(e.value).split("loading them again:")[1].split("]")[0])
        assert refused[0] == refused[1] and "lm_head.weight" in refused[0]
        state = model.state_dict()
        del state["lm_head.weight"]
        copies = Copies()
        with copies:
            save_file(state, tmp_path / "model.safetensors")
        assert copies.bytes == 0
        assert (tmp_path / "model.safetensors").stat().st_size < _unique_bytes(state) + FILE_SLACK * len(state)
        back = load_file(tmp_path / "model.safetensors")
        assert back.keys() == state.keys() and all(torch.equal(back[k], state[k]) for k in state)
        save_model(model, tmp_path / "whole.safetensors")
        fresh, _ = _gpt2()
        load_model(fresh, tmp_path / "whole.safetensors")
        for name, t in model.state_dict().items():
            assert torch.equal(fresh.state_dict()[name], t), name
    finally:
        _close(w, host)


def test_hugging_face_save_pretrained_copies_nothing_and_from_pretrained_gives_the_trained_weights(tmp_path) -> None:
    """A tiny HF GPT-2 (from a config) trained wrapped as `OwnLoss`: save_pretrained of the HF model inside (its
    default safe serialization) copies no weight (transformers clones tensors that share storage and are not tied),
    writes each weight once, and from_pretrained gives the trained weights back, the head tied again."""
    import hf_models
    import transformers

    torch.manual_seed(0)
    model = hf_models.build("gpt2", "eager")
    inputs = hf_models.batches("gpt2")(0)
    w, host = _on_host(model, inputs)
    try:
        _step(w, host, inputs)
        hf = model.model
        copies = Copies()
        with copies:
            hf.save_pretrained(tmp_path / "hf")
        assert copies.bytes == 0
        state = hf.state_dict()
        size = (tmp_path / "hf" / "model.safetensors").stat().st_size
        assert size < _unique_bytes(state) + FILE_SLACK * len(state)
        back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
        assert back.state_dict().keys() == state.keys()
        for name, t in back.state_dict().items():
            assert torch.equal(t, state[name]), name
        assert back.lm_head.weight is back.transformer.wte.weight
    finally:
        _close(w, host)


def test_load_state_dict_into_the_trained_model_copies_into_its_buckets_and_resumes_as_eager() -> None:
    """Two steps, a state taken, a third step, then the state loaded back into the trained model and into the eager
    one (each keeps its AdamW state): the parameters stay views of their buckets and two more steps equal eager."""
    model, inputs = _gpt2()
    ref, _ = _gpt2()
    opt = _eager_adamw(ref)
    w, host = _on_host(model, inputs)
    try:
        for _ in range(2):
            _step(w, host, inputs)
            _eager_step(ref, opt, inputs)
        saved = {k: t.clone() for k, t in model.state_dict().items()}
        _step(w, host, inputs)
        _eager_step(ref, opt, inputs)
        model.load_state_dict(saved)
        ref.load_state_dict(saved)
        _assert_views_of_buckets(host)
        for name, t in model.state_dict().items():
            assert torch.equal(t, saved[name]), name
        for _ in range(2):
            _step(w, host, inputs)
            _eager_step(ref, opt, inputs)
        for p, q in zip(model.parameters(), ref.parameters()):
            assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6)
    finally:
        _close(w, host)


def test_a_load_reaches_the_master_weights_of_bf16_weights_and_of_the_delayed_update() -> None:
    """Where the master weights are kept apart (bf16 weights; the delayed update), a load_state_dict into the
    wrapped model sets them to the loaded weights, exactly, so the next update starts from what was loaded and
    no delayed update writes over it: the weights after a step are within one step of the loaded ones."""
    for dtype, delayed in ((torch.bfloat16, False), (torch.float32, True)):
        model, inputs = _gpt2()
        model.to(dtype)
        w, host = _on_host(model, inputs, delayed=delayed)
        try:
            for _ in range(3):
                _step(w, host, inputs)
            loaded = {k: torch.randn_like(t) * 0.02 for k, t in model.state_dict().items()}
            loaded["lm_head.weight"] = loaded["wte.weight"]  # tied: one weight
            w.load_state_dict({f"module.{k}": t for k, t in loaded.items()})
            names = {p: n for n, p in model.named_parameters()}
            masters = host.master(names)["weights"]
            assert masters.keys() == set(names.values())
            for name, master in masters.items():
                assert torch.equal(master, loaded[name].float()), name
            _step(w, host, inputs)
            host.flush()
            for name, p in model.named_parameters():
                # an Adam step moves a weight by at most lr (1 - beta1) / sqrt(1 - beta2) = 3.2 lr; from the stale
                # master weights the layer norms' would be near 1, the others ~0.02 (the weights' scale) away
                assert_close(p.detach().float(), loaded[name].float(), rtol=0, atol=4 * LR)
        finally:
            _close(w, host)


def test_pinned_slabs_save_each_weight_once_and_load_in_place(pins, tmp_path) -> None:  # noqa: F811
    """Beside "a GPU" (pinning faked): the buckets' weights and the module's other tensors live in pinned slabs;
    the state_dict gives each its own memory (nothing copied), torch.save writes each once (not the slabs), and a
    load copies into the slabs in place."""
    model, inputs = _gpt2()
    ref, _ = _gpt2()
    opt = _eager_adamw(ref)
    w, host = _on_host(model, inputs, pin=True)
    try:
        _step(w, host, inputs)
        _eager_step(ref, opt, inputs)
        assert all(p.is_pinned() for p in model.parameters())
        state = model.state_dict()
        _assert_each_entry_is_its_weight(state, model)
        torch.save(state, tmp_path / "model.pt")
        assert (tmp_path / "model.pt").stat().st_size < _unique_bytes(state) + FILE_SLACK * len(state)
        for name, t in torch.load(tmp_path / "model.pt").items():
            assert_close(t, ref.state_dict()[name], rtol=1e-5, atol=1e-6)
        model.load_state_dict(_gpt2()[0].state_dict())
        _assert_views_of_buckets(host)
        assert all(p.is_pinned() for p in model.parameters())
        for name, t in model.state_dict().items():
            assert torch.equal(t, _gpt2()[0].state_dict()[name]), name
    finally:
        _close(w, host)


def test_assign_is_refused_in_one_line_and_keep_vars_gives_the_live_parameters() -> None:
    """load_state_dict(assign=True) would part the parameters from their buckets: a one-line error before
    anything is loaded; state_dict(keep_vars=True) gives the parameters themselves, as eager."""
    model, inputs = _gpt2()
    w, host = _on_host(model, inputs)
    try:
        before = {k: t.clone() for k, t in model.state_dict().items()}
        with pytest.raises(XschedError, match="assign=True") as e:
            model.load_state_dict(_gpt2()[0].state_dict(), assign=True)
        assert "\n" not in str(e.value)
        _assert_views_of_buckets(host)
        assert all(torch.equal(t, before[k]) for k, t in model.state_dict().items())
        live = model.state_dict(keep_vars=True)
        assert all(live[n] is p for n, p in model.named_parameters(remove_duplicate=False))
    finally:
        _close(w, host)
