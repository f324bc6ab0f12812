"""Tiny Hugging Face models for the tests (built from configs, nothing downloaded), each as a module that returns its
own training loss, with batches made for it: causal LMs, a masked-LM encoder and an encoder-decoder."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from xsched.train.hf import OwnLoss

VOCAB, SEQ, BATCH = 64, 64, 8

# head dims: gpt2 16, llama 32 (grouped-query: 2 heads, 1 key/value head), qwen2 128, bert 16, bart 64; two layers
# each (bart: one encoder and one decoder layer); activations outweigh the weights, as in training at real sizes
CONFIGS: dict[str, dict] = {
    "gpt2": dict(n_layer=2, n_embd=32, n_head=2, n_positions=SEQ),
    "llama": dict(
        num_hidden_layers=2, hidden_size=64, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1
    ),
    "qwen2": dict(
        num_hidden_layers=2, hidden_size=128, intermediate_size=64, num_attention_heads=1, num_key_value_heads=1
    ),
    "bert": dict(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2),
    "bart": dict(
        encoder_layers=1,
        decoder_layers=1,
        d_model=64,
        encoder_attention_heads=1,
        decoder_attention_heads=1,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
    ),
}
HEAD_DIM = {"gpt2": 16, "llama": 32, "qwen2": 128, "bert": 16, "bart": 64}


def build(name: str, attn: str) -> nn.Module:
    """The model of family `name` with `attn` attention ("sdpa" or "eager"), fresh weights from torch's generator."""
    import transformers

    transformers.logging.set_verbosity_error()
    kw = dict(CONFIGS[name], vocab_size=VOCAB)
    if name not in ("gpt2", "bart"):
        kw["max_position_embeddings"] = SEQ
    if name == "bart":
        kw.update(max_position_embeddings=SEQ, pad_token_id=1, bos_token_id=0, eos_token_id=2)
    config = transformers.AutoConfig.for_model(name, **kw)
    config.use_cache = False
    auto = {"bert": transformers.AutoModelForMaskedLM, "bart": transformers.AutoModelForSeq2SeqLM}
    model = auto.get(name, transformers.AutoModelForCausalLM).from_config(config, attn_implementation=attn)
    return OwnLoss(model.train())


def batches(name: str) -> Callable[[int], tuple[torch.Tensor, torch.Tensor]]:
    """step -> (input_ids, labels): next tokens for causal LMs and seq2seq, a masked 25% for the masked LM."""

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(100 + step)
        ids = torch.randint(3, VOCAB, (BATCH, SEQ), generator=g)
        if name != "bert":
            return ids, ids.clone()
        masked = torch.rand(BATCH, SEQ, generator=g) < 0.25
        masked[:, 0] = True  # at least one label per row
        labels = torch.where(masked, ids, torch.full_like(ids, -100))
        return torch.where(masked, torch.full_like(ids, 4), ids), labels

    return batch
