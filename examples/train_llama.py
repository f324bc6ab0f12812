"""A training factory for `xsched train`: a Llama-style decoder in plain PyTorch (RMSNorm, rotary position
embeddings, grouped-query attention, SwiGLU MLP, untied LM head), on the arithmetic sequences of the zoo's gpt2
task, or on a token file with --data.

    xsched train examples/train_llama.py:factory --budget cpu=70% --steps 50 --precision bf16
    xsched train examples/train_llama.py:factory --budget cpu=70% --data train.bin --val-data val.bin --eval-every 25

The factory returns (model, example_batch, loss_fn, batches) with batches ((idx,), targets): `--data` fills that
layout with windows of the token file. Sizes are arguments: factory(batch=8, seq=128, vocab=256, dim=128, layers=4).
"""

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


def rotary(seq: int, head_dim: int, base: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of each position's rotation angles, (seq, head_dim)."""
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2).float() / head_dim)
    angles = torch.outer(torch.arange(seq).float(), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    turned = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + turned * sin


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.q = nn.Linear(dim, dim, bias=False)
        self.kv = nn.Linear(dim, 2 * kv_heads * self.head_dim, bias=False)
        self.o = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q = self.q(x).view(B, T, self.heads, self.head_dim).transpose(1, 2)
        k, v = self.kv(x).view(B, T, 2, self.kv_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        group = self.heads // self.kv_heads  # grouped-query attention: each key/value head serves `group` heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(B, T, C))


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.gate = nn.Linear(dim, hidden, bias=False)
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int, hidden: int) -> None:
        super().__init__()
        self.attn_norm, self.attn = RMSNorm(dim), Attention(dim, heads, kv_heads)
        self.mlp_norm, self.mlp = RMSNorm(dim), MLP(dim, hidden)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
    """forward(idx) -> logits (B, T, vocab)."""

    def __init__(self, vocab: int, dim: int, layers: int, heads: int, kv_heads: int, seq: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, kv_heads, 4 * dim * 2 // 3) for _ in range(layers))
        self.norm = RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        cos, sin = rotary(seq, dim // heads)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, 0.0, 0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.shape[1]
        cos, sin = self.cos[:T], self.sin[:T]
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.head(self.norm(x))


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def factory(batch: int = 8, seq: int = 128, vocab: int = 256, dim: int = 128, layers: int = 4):
    model = Llama(vocab, dim, layers, heads=4, kv_heads=2, seq=seq)

    def batches(step: int, rank: int, world: int):
        """Rank's rows of the step's arithmetic sequences mod vocab (random start and stride 1-3)."""
        gen = torch.Generator().manual_seed(step)
        start = torch.randint(0, vocab, (world * batch, 1), generator=gen)
        stride = torch.randint(1, 4, (world * batch, 1), generator=gen)
        tokens = ((start + stride * torch.arange(seq + 1)) % vocab)[rank * batch : (rank + 1) * batch]
        return (tokens[:, :-1].contiguous(),), tokens[:, 1:].contiguous()

    return model, batches(0, 0, 1), next_token_loss, batches
