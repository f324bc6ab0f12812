"""LoRA through xsched: `wrap` on a peft model trains the adapters equal to eager while the frozen weights get no
gradient (the captured graph computes none) and no optimizer state; `xsched train hf:TYPE --lora ...` fine-tunes a
save_pretrained folder and saves adapters PeftModel.from_pretrained loads; bad --lora input is one line, exit 2."""

from __future__ import annotations

import copy
import sys

import pytest
import torch
from hf_models import batches, build
from test_hf_models import train3
from torch.testing import assert_close

from xsched import wrap
from xsched.cli import main
from xsched.train.checkpoint import read_checkpoint
from xsched.train.hf import parse_overrides

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
pytestmark = pytest.mark.usefixtures("one_thread")

LLAMA = "num_hidden_layers=2,hidden_size=32,intermediate_size=64,num_attention_heads=4,num_key_value_heads=2,"
LLAMA += "vocab_size=64,max_position_embeddings=16"


def lora(model: torch.nn.Module) -> torch.nn.Module:
    config = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    model.model = peft.get_peft_model(model.model, config)
    return model


def test_wrap_trains_adapters_like_eager_and_frozen_weights_get_nothing() -> None:
    torch.manual_seed(0)
    model = lora(build("llama", "sdpa"))
    ref = copy.deepcopy(model)
    batch = batches("llama")
    trained = {k for k, p in model.named_parameters() if p.requires_grad}
    frozen = {k: p.shape for k, p in model.named_parameters() if not p.requires_grad}
    assert trained and all("lora_" in k for k in trained)
    wrapped = wrap(model, batch(0), {"cpu": "70%"}, method="checkpoint", profile="model")
    graph = wrapped.graph
    assert set(graph.grads or {}) == trained  # the plan makes gradients for the adapters only
    assert not {v.grad_of for v in graph.values if v.grad_of} & {f"param:{k}" for k in frozen}
    # no backward op makes a weight-shaped value: the frozen weights' gradients are not computed, then dropped
    square = tuple(frozen["model.base_model.model.model.layers.0.mlp.up_proj.weight"])
    assert not [o.id for o in graph.ops if o.phase == "bwd" for v in o.outputs if graph.value[v].shape == square]
    got_loss, got_grads = train3(model, wrapped, batch)
    want_loss, want_grads = train3(ref, ref, batch)
    assert_close(torch.stack(got_loss), torch.stack(want_loss), rtol=1e-5, atol=1e-6)
    for got, want in zip(got_grads, want_grads):
        assert got.keys() == want.keys() == trained
        assert_close(got, want, rtol=1e-4, atol=1e-6)
    assert_close(dict(model.named_parameters()), dict(ref.named_parameters()), rtol=1e-4, atol=1e-5)
    assert all(p.grad is None for k, p in model.named_parameters() if k in frozen)


def test_train_lora_on_a_pretrained_folder_saves_adapters_peft_loads(tmp_path, capsys) -> None:
    torch.manual_seed(7)
    config = transformers.LlamaConfig(**parse_overrides(LLAMA), use_cache=False)
    base = transformers.LlamaForCausalLM(config)
    base.save_pretrained(tmp_path / "base")
    ck = tmp_path / "ck"
    args = ["train", "hf:llama", "--pretrained", str(tmp_path / "base"), "--batch", "2", "--budget", "cpu=100%"]
    args += ["--steps", "2", "--profile", "model", "--method", "sqrt", "--cache-dir", str(tmp_path), "--json"]
    assert main([*args, "--lora", "r=8,alpha=16,targets=q_proj,v_proj", "--checkpoint-dir", str(ck)]) == 0
    capsys.readouterr()
    state = read_checkpoint(ck, 2)["model"]
    loaded = peft.PeftModel.from_pretrained(
        transformers.LlamaForCausalLM.from_pretrained(tmp_path / "base"), ck / "adapter"
    )
    mine = {k.removeprefix("lm."): v for k, v in state.items()}
    theirs = loaded.state_dict()
    adapters = [k for k in theirs if "lora_" in k]
    assert len(adapters) == 2 * 2 * 2  # A and B of q_proj and v_proj in 2 layers
    for k in theirs:
        assert_close(theirs[k], mine[k], rtol=0, atol=0)  # adapters as trained, base weights as saved
    assert any(mine[k].abs().sum() > 0 for k in adapters if "lora_B" in k)  # B starts at zero: it trained
    assert_close(
        mine["base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"],
        base.model.layers[0].self_attn.q_proj.weight,
        rtol=0,
        atol=0,
    )  # frozen

    # a second run starts from those adapters and trains them further
    ck2 = tmp_path / "ck2"
    assert main([*args, "--lora", str(ck / "adapter"), "--checkpoint-dir", str(ck2)]) == 0
    capsys.readouterr()
    assert (ck2 / "adapter" / "adapter_config.json").is_file()


def _one_line_exit_2(args: list[str], capsys) -> str:
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err, err
    return err


def test_bad_lora_input_is_one_line(tmp_path, capsys, monkeypatch) -> None:
    args = ["train", "hf:llama", "--config", LLAMA, "--budget", "cpu=100%", "--steps", "1", "--profile", "model"]
    err = _one_line_exit_2([*args, "--lora", "r=8,targets=c_attn"], capsys)
    assert "--lora targets c_attn: hf:llama has no such module" in err and "q_proj" in err
    bad = tmp_path / "adapter"
    bad.mkdir()
    (bad / "adapter_config.json").write_text("{not json")
    err = _one_line_exit_2([*args, "--lora", str(bad)], capsys)
    assert f"--lora {bad}: cannot load its adapters onto hf:llama" in err
    monkeypatch.setitem(sys.modules, "peft", None)  # as if peft were not installed
    err = _one_line_exit_2([*args, "--lora", "r=8,targets=q_proj"], capsys)
    assert "--lora needs peft: pip install 'xsched[lora]'" in err
