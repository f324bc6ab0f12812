"""Llama-shaped decoder: pre-norm blocks with RMSNorm, rotary position embeddings, grouped-query attention (explicit
causal attention, so the captured graph holds plain aten ops), a SwiGLU MLP and an LM head tied to the embedding; forward(idx,
targets) -> (logits, loss) as the zoo's gpt2. `full` is Llama 3.2 3B's shape (3.2B parameters) at sequence 1024."""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from xsched.zoo import drawn_once


@dataclass(frozen=True)
class LlamaConfig:
    n_layer: int = 28
    n_head: int = 24
    n_kv_head: int = 8
    n_embd: int = 3072
    ffn: int = 8192
    vocab: int = 128256
    block_size: int = 2048
    rope_theta: float = 500000.0
    seq: int = 1024
    batch: int = 2


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # in fp32 and back, as Llama does, so a bf16 model normalises as precisely as an fp32 one
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return h.to(x.dtype) * self.weight


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of (B, H, T, hs) with the half-split layout (Hugging Face's rotate_half); cos and sin are
    (T, hs / 2)."""
    a, b = x.chunk(2, dim=-1)
    return torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        if cfg.n_embd % cfg.n_head or cfg.n_head % cfg.n_kv_head:
            raise ValueError(f"llama n_embd={cfg.n_embd}, n_head={cfg.n_head}, n_kv_head={cfg.n_kv_head} do not divide")
        self.n_head, self.n_kv = cfg.n_head, cfg.n_kv_head
        self.hs = cfg.n_embd // cfg.n_head
        self.q_proj = nn.Linear(cfg.n_embd, cfg.n_head * self.hs, bias=False)
        self.k_proj = nn.Linear(cfg.n_embd, cfg.n_kv_head * self.hs, bias=False)
        self.v_proj = nn.Linear(cfg.n_embd, cfg.n_kv_head * self.hs, bias=False)
        self.o_proj = nn.Linear(cfg.n_head * self.hs, cfg.n_embd, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, future: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_head, self.hs).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.n_kv, self.hs).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_kv, self.hs).transpose(1, 2)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        rep = self.n_head // self.n_kv  # grouped-query attention: each key/value head serves `rep` query heads
        k = k[:, :, None].expand(B, self.n_kv, rep, T, self.hs).reshape(B, self.n_head, T, self.hs)
        v = v[:, :, None].expand(B, self.n_kv, rep, T, self.hs).reshape(B, self.n_head, T, self.hs)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.hs))
        att = F.softmax(att.masked_fill(future, float("-inf")).float(), dim=-1).to(q.dtype)
        return self.o_proj((att @ v).transpose(1, 2).reshape(B, T, -1))


class SwiGLU(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.n_embd, cfg.ffn, bias=False)
        self.up_proj = nn.Linear(cfg.n_embd, cfg.ffn, bias=False)
        self.down_proj = nn.Linear(cfg.ffn, cfg.n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.n_embd)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.n_embd)
        self.mlp = SwiGLU(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, future: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, future)
        return x + self.mlp(self.post_attention_layernorm(x))


class Llama(nn.Module):
    """forward(idx, targets) -> (logits, loss); loss is None without targets."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.block_size = cfg.block_size
        self.embed_tokens = nn.Embedding(cfg.vocab, cfg.n_embd)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.norm = RMSNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab, bias=False)
        self.lm_head.weight = self.embed_tokens.weight  # tied, as Llama 3.2's 1B and 3B
        # not saved in state dicts; fp32 here, cast with the model (as Hugging Face computes them per dtype)
        for name, value in rope_buffers(cfg).items():
            self.register_buffer(name, value, persistent=False)
        self.init_weights()

    def init_weights(self) -> None:
        """normal(0, 0.02) over every matrix (the embedding and its tied head once), in parameter order."""
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, 0.0, 0.02)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        T = idx.shape[1]
        if T > self.block_size:
            raise ValueError(f"llama sequence length {T} exceeds block_size {self.block_size}")
        x = self.embed_tokens(idx)
        cos, sin, future = self.cos[:T].to(x.dtype), self.sin[:T].to(x.dtype), self.future[:T, :T]
        for layer in self.layers:
            x = layer(x, cos, sin, future)
        logits = self.lm_head(self.norm(x))
        if targets is None:
            return logits, None
        return logits, F.cross_entropy(logits.view(-1, logits.shape[-1]).float(), targets.reshape(-1))


def scales(name: str) -> dict[str, LlamaConfig]:
    return {
        "tiny": LlamaConfig(2, 4, 2, 32, 64, 64, 32, 10000.0, 16, 2),
        "small": LlamaConfig(4, 4, 2, 64, 172, 256, 64, 10000.0, 64, 4),
        "default": LlamaConfig(6, 6, 2, 192, 512, 1024, 128, 10000.0, 128, 8),
        "full": LlamaConfig(),
    }


def rope_buffers(cfg: LlamaConfig) -> dict[str, torch.Tensor]:
    """The rotary embedding's cos and sin (block_size, head size / 2) and the causal mask's future positions."""
    hs = cfg.n_embd // cfg.n_head
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, hs, 2, dtype=torch.float32) / hs))
    angles = torch.outer(torch.arange(cfg.block_size, dtype=torch.float32), inv)
    future = torch.ones(cfg.block_size, cfg.block_size, dtype=torch.bool).triu(1)
    return {"cos": angles.cos(), "sin": angles.sin(), "future": future}


def make_model(cfg: LlamaConfig) -> nn.Module:
    """The model on the current default device; a large one on the CPU gets its weights drawn once (drawn_once)."""
    if cfg.seq > cfg.block_size:
        raise ValueError(f"llama seq={cfg.seq} exceeds block_size={cfg.block_size}")
    return drawn_once.built(partial(Llama, cfg), _init_draws(cfg), partial(_init_after_draws, cfg))


def _init_after_draws(cfg: LlamaConfig, model: Llama) -> None:
    """What Llama(cfg) sets after torch's own init draws, on a model built on the meta device: the norms' ones, the
    rotary and mask buffers, then the zoo's normal_."""
    for name, value in rope_buffers(cfg).items():
        setattr(model, name, value)  # a registered buffer stays one, not saved in state dicts
    for m in model.modules():
        if isinstance(m, RMSNorm):
            nn.init.ones_(m.weight)
    model.init_weights()


def _init_draws(cfg: LlamaConfig) -> int:
    """The 32-bit draws torch's own init takes from the global generator in Llama(cfg) on the CPU (float32): the
    embedding's normal_ (one per value, and 16 more when their count is not a multiple of 16: the last 16 are drawn
    again; under 16 values it draws otherwise, never at a size that jumps), every Linear's kaiming uniform_ (one
    per value), the head's included before it is tied."""
    hs = cfg.n_embd // cfg.n_head
    embedding = cfg.vocab * cfg.n_embd
    attention = cfg.n_embd * hs * (2 * cfg.n_head + 2 * cfg.n_kv_head)  # q and o; k and v
    mlp = 3 * cfg.n_embd * cfg.ffn
    return embedding + (16 if embedding % 16 else 0) + cfg.n_layer * (attention + mlp) + cfg.vocab * cfg.n_embd


def make_inputs(cfg: LlamaConfig, batch: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    tokens = torch.randint(0, cfg.vocab, (batch, cfg.seq + 1), generator=gen)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()  # next-token targets
