"""GPT-2 style decoder (nanoGPT-like): pre-LN blocks, explicit causal attention, GELU MLP, tied LM head."""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from xsched.zoo import drawn_once


@dataclass(frozen=True)
class GPTConfig:
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    block_size: int = 1024
    vocab: int = 50257
    dropout: float = 0.1
    seq: int = 1024  # length of the example sequences (<= block_size)
    batch: int = 8


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, block_size: int, dropout: float) -> None:
        super().__init__()
        if n_embd % n_head:
            raise ValueError(f"gpt2 n_embd={n_embd} is not divisible by n_head={n_head}")
        self.n_head = n_head
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.attn_dropout = nn.Dropout(dropout)
        self.resid_dropout = nn.Dropout(dropout)
        self.register_buffer("future", causal_future(block_size), persistent=False)  # not saved in state dicts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        hs = C // self.n_head
        q, k, v = (t.view(B, T, self.n_head, hs).transpose(1, 2) for t in self.c_attn(x).split(C, dim=2))
        # explicit matmul/masked_fill/softmax rather than SDPA, so the captured graph holds plain aten ops
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hs))
        att = att.masked_fill(self.future[:T, :T], float("-inf"))
        att = self.attn_dropout(F.softmax(att, dim=-1))
        y = (att @ v).transpose(1, 2).reshape(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, n_embd: int, dropout: float) -> None:
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd)
        self.gelu = nn.GELU(approximate="tanh")  # GPT-2's GELU
        self.c_proj = nn.Linear(4 * n_embd, n_embd)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int, block_size: int, dropout: float) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, block_size, dropout)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = MLP(n_embd, dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """forward(idx, targets) -> (logits, loss); loss is None without targets."""

    def __init__(
        self,
        n_layer: int = 12,
        n_head: int = 12,
        n_embd: int = 768,
        block_size: int = 1024,
        vocab: int = 50257,
        dropout: float = 0.1,
    ) -> None:
        super().__init__()
        self.block_size = block_size
        self.wte = nn.Embedding(vocab, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.h = nn.ModuleList(Block(n_embd, n_head, block_size, dropout) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # tied, as in GPT-2
        self.init_weights()

    def init_weights(self) -> None:
        """GPT-2's: normal(0, 0.02) over every matrix (the embedding and its tied head once), the residual paths'
        projections scaled by 1/sqrt(2 n_layer), the Linears' biases zero; in parameter order."""
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):  # GPT-2's residual-path scaling
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * len(self.h)))
            elif p.dim() == 2:
                nn.init.normal_(p, 0.0, 0.02)
            elif name.endswith("bias") and "ln" not in name:
                nn.init.zeros_(p)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        T = idx.shape[1]
        if T > self.block_size:
            raise ValueError(f"gpt2 sequence length {T} exceeds block_size {self.block_size}")
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits, None
        return logits, F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))


def scales(name: str) -> dict[str, GPTConfig]:
    return {
        "tiny": GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=32, vocab=64, seq=16, batch=2),
        "small": GPTConfig(n_layer=4, n_head=4, n_embd=64, block_size=64, vocab=256, seq=64, batch=4),
        "default": GPTConfig(n_layer=6, n_head=6, n_embd=192, block_size=128, vocab=1024, seq=128, batch=8),
        "full": GPTConfig(),
    }


def causal_future(block_size: int) -> torch.Tensor:
    """(block_size, block_size) bool, True above the diagonal: the future positions attention hides."""
    return torch.ones(block_size, block_size, dtype=torch.bool).triu(1)


def make_model(cfg: GPTConfig) -> nn.Module:
    """The model on the current default device; a large one on the CPU gets its weights drawn once (drawn_once)."""
    if cfg.seq > cfg.block_size:
        raise ValueError(f"gpt2 seq={cfg.seq} exceeds block_size={cfg.block_size}")
    build = partial(GPT, cfg.n_layer, cfg.n_head, cfg.n_embd, cfg.block_size, cfg.vocab, cfg.dropout)
    return drawn_once.built(build, _init_draws(cfg), partial(_init_after_draws, cfg))


def _init_after_draws(cfg: GPTConfig, model: GPT) -> None:
    """What GPT(...) sets after torch's own init draws, on a model built on the meta device: the LayerNorms' ones
    and zeros (their reset draws nothing), the attention masks, then the zoo's init."""
    for m in model.modules():
        if isinstance(m, nn.LayerNorm):
            m.reset_parameters()
        elif isinstance(m, CausalSelfAttention):
            m.future = causal_future(cfg.block_size)  # a registered buffer stays one, not saved in state dicts
    model.init_weights()


def _init_draws(cfg: GPTConfig) -> int:
    """The 32-bit draws torch's own init takes from the global generator in GPT(...) on the CPU (float32): each
    embedding's normal_ (one per value, and 16 more when their count is not a multiple of 16: the last 16 are drawn
    again; under 16 values it draws otherwise, never at a size that jumps), every Linear's kaiming uniform_ and its
    bias's uniform_ (one per value), the head's included before it is tied."""
    C = cfg.n_embd

    def embedding(rows: int) -> int:
        return rows * C + (16 if rows * C % 16 else 0)

    block = 12 * C * C + 9 * C  # c_attn C x 3C, attn c_proj C x C, c_fc C x 4C, mlp c_proj 4C x C; their biases
    return embedding(cfg.vocab) + embedding(cfg.block_size) + cfg.n_layer * block + cfg.vocab * C


def make_inputs(cfg: GPTConfig, batch: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    tokens = torch.randint(0, cfg.vocab, (batch, cfg.seq + 1), generator=gen)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()  # next-token targets
