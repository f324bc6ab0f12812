"""Encoder-decoder Transformer: token embeddings + learned positions around torch.nn.Transformer, then a vocab projection."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class TransformerConfig:
    d_model: int = 512
    nhead: int = 8
    encoder_layers: int = 6
    decoder_layers: int = 6
    ff: int = 2048
    dropout: float = 0.1
    vocab: int = 32000
    src_len: int = 128
    tgt_len: int = 128
    batch: int = 16


class Seq2SeqTransformer(nn.Module):
    """forward(src, tgt) -> logits over the target vocabulary, shape (batch, tgt_len, vocab)."""

    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        d, max_len = cfg.d_model, max(cfg.src_len, cfg.tgt_len)
        self.scale = math.sqrt(d)
        self.src_emb = nn.Embedding(cfg.vocab, d)
        self.tgt_emb = nn.Embedding(cfg.vocab, d)
        self.pos = nn.Parameter(torch.randn(max_len, d) * 0.02)
        self.transformer = nn.Transformer(
            d, cfg.nhead, cfg.encoder_layers, cfg.decoder_layers, cfg.ff, cfg.dropout, batch_first=True
        )
        self.out = nn.Linear(d, cfg.vocab)
        # An additive causal mask as a buffer. Passing tgt_is_causal=True with it keeps nn.Transformer from
        # comparing the mask against a fresh one (_detect_is_causal_mask), a data-dependent check that breaks tracing.
        causal = torch.full((max_len, max_len), float("-inf")).triu(1)
        self.register_buffer("causal", causal, persistent=False)

    def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        S, T = src.shape[1], tgt.shape[1]
        s = self.src_emb(src) * self.scale + self.pos[:S]
        t = self.tgt_emb(tgt) * self.scale + self.pos[:T]
        h = self.transformer(s, t, tgt_mask=self.causal[:T, :T], src_is_causal=False, tgt_is_causal=True)
        return self.out(h)


def scales(name: str) -> dict[str, TransformerConfig]:
    return {
        "tiny": TransformerConfig(32, 2, 2, 2, 64, vocab=64, src_len=16, tgt_len=16, batch=2),
        "small": TransformerConfig(64, 4, 2, 2, 256, vocab=256, src_len=32, tgt_len=32, batch=4),
        "default": TransformerConfig(256, 8, 3, 3, 1024, vocab=1024, src_len=64, tgt_len=64, batch=8),
        "full": TransformerConfig(),
    }


def make_model(cfg: TransformerConfig) -> nn.Module:
    return Seq2SeqTransformer(cfg)


def make_inputs(cfg: TransformerConfig, batch: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    src = torch.randint(0, cfg.vocab, (batch, cfg.src_len), generator=gen)
    tgt = torch.randint(0, cfg.vocab, (batch, cfg.tgt_len), generator=gen)
    return src, tgt
