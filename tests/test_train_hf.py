"""`xsched train hf:TYPE`: Hugging Face causal LMs built from their config class (nothing downloaded) train like
the same transformers model trained in plain PyTorch (GPT-2 with its dropout, a Llama config with grouped-query
attention), and `--pretrained DIR` starts from the weights save_pretrained wrote there."""

from __future__ import annotations

from functools import partial

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close
from train_support import assert_same_weights, eager_train

from xsched.cli import main
from xsched.train import TrainConfig, train
from xsched.train.checkpoint import read_checkpoint
from xsched.train.hf import parse_overrides
from xsched.zoo import tasks

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")

SIZES = {
    "gpt2": "n_layer=2,n_embd=32,n_head=2,vocab_size=64,n_positions=16",
    "llama": "num_hidden_layers=2,hidden_size=32,intermediate_size=64,num_attention_heads=4,num_key_value_heads=2,"
    "vocab_size=64,max_position_embeddings=16",
}


def eager(spec: str, model: torch.nn.Module, steps: int) -> dict:
    class Plain(torch.nn.Module):  # the transformers model, called as xsched's batches call it
        def __init__(self) -> None:
            super().__init__()
            self.lm = model

        def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(self.lm(input_ids=idx).logits.flatten(0, 1).float(), targets.flatten())

    return eager_train(Plain(), partial(tasks.sequence_batch, spec, 64, 16, 2), lambda loss, _: loss, steps)


def built(name: str) -> torch.nn.Module:
    config = transformers.AutoConfig.for_model(name, **parse_overrides(SIZES[name]))
    config.use_cache = False
    return transformers.AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_hf_models_train_like_eager(name, tmp_path) -> None:
    config = TrainConfig(
        f"hf:{name}",
        {"cpu": "100%"},
        steps=5,
        batch=2,
        hf_config=SIZES[name],
        method="sqrt",
        profile="model",
        cache_dir=str(tmp_path),
        checkpoint_dir=str(tmp_path / "ck"),
    )
    result = train(config)
    torch.manual_seed(0)
    want = eager(f"hf:{name}", built(name), 5)
    assert_close(result.losses, want["loss"], rtol=1e-5, atol=1e-6)
    if name == "gpt2":  # dropout 0.1 reproduced: the same masks, so the same numbers
        assert result.losses == want["loss"]
    assert_same_weights(read_checkpoint(tmp_path / "ck", 5)["model"], want["model"], rtol=1e-5, atol=1e-6)


def test_pretrained_weights_are_loaded_and_trained(tmp_path, capsys) -> None:
    """save_pretrained of a GPT-2 whose weights differ from a fresh draw, then hf:gpt2 --pretrained DIR: the first
    steps are those of plain PyTorch from the saved weights; a folder of another model type is one line."""
    torch.manual_seed(123)
    saved = built("gpt2")
    saved.save_pretrained(tmp_path / "gpt2")
    ck = tmp_path / "ck"
    args = ["train", "hf:gpt2", "--pretrained", str(tmp_path / "gpt2"), "--batch", "2", "--budget", "cpu=100%"]
    args += ["--steps", "2", "--profile", "model", "--method", "sqrt", "--cache-dir", str(tmp_path)]
    assert main([*args, "--checkpoint-dir", str(ck), "--json"]) == 0
    capsys.readouterr()
    torch.manual_seed(0)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "gpt2")
    loaded.config.use_cache = False
    loaded.train()  # from_pretrained hands over eval mode; xsched trains in train mode (dropout on)
    want = eager("hf:gpt2", loaded, 2)
    assert_same_weights(read_checkpoint(ck, 2)["model"], want["model"], rtol=1e-5, atol=1e-6)

    built("llama").save_pretrained(tmp_path / "llama")
    assert main(["train", "hf:gpt2", "--pretrained", str(tmp_path / "llama"), "--budget", "cpu=100%"]) == 2
    assert "holds a llama model, not hf:gpt2" in capsys.readouterr().err
