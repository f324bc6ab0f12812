"""MLP-Mixer: patch-embedding conv, token-mixing and channel-mixing MLPs with LayerNorm and GELU, mean pool, head."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class MixerConfig:
    patch: int = 16
    hidden: int = 768
    layers: int = 12
    tokens_mlp: int = 384
    channels_mlp: int = 3072
    image: int = 224  # must be divisible by patch
    classes: int = 1000
    batch: int = 32


class MlpBlock(nn.Sequential):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim))


class MixerBlock(nn.Module):
    def __init__(self, tokens: int, cfg: MixerConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.hidden)
        self.token_mix = MlpBlock(tokens, cfg.tokens_mlp)
        self.norm2 = nn.LayerNorm(cfg.hidden)
        self.channel_mix = MlpBlock(cfg.hidden, cfg.channels_mlp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (batch, tokens, hidden)
        x = x + self.token_mix(self.norm1(x).transpose(1, 2)).transpose(1, 2)
        return x + self.channel_mix(self.norm2(x))


class MlpMixer(nn.Module):
    def __init__(self, cfg: MixerConfig) -> None:
        super().__init__()
        if cfg.image % cfg.patch:
            raise ValueError(f"mlp_mixer image side {cfg.image} is not divisible by patch {cfg.patch}")
        tokens = (cfg.image // cfg.patch) ** 2
        self.stem = nn.Conv2d(3, cfg.hidden, cfg.patch, stride=cfg.patch)
        self.blocks = nn.Sequential(*(MixerBlock(tokens, cfg) for _ in range(cfg.layers)))
        self.norm = nn.LayerNorm(cfg.hidden)
        self.head = nn.Linear(cfg.hidden, cfg.classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x).flatten(2).transpose(1, 2)  # (batch, tokens, hidden)
        x = self.norm(self.blocks(x))
        return self.head(x.mean(dim=1))


def scales(name: str) -> dict[str, MixerConfig]:
    return {
        "tiny": MixerConfig(patch=8, hidden=16, layers=2, tokens_mlp=8, channels_mlp=32, image=32, classes=10, batch=2),
        "small": MixerConfig(
            patch=8, hidden=64, layers=4, tokens_mlp=32, channels_mlp=256, image=64, classes=100, batch=4
        ),
        "default": MixerConfig(
            patch=8, hidden=256, layers=8, tokens_mlp=128, channels_mlp=1024, image=64, classes=100, batch=16
        ),
        "full": MixerConfig(),  # Mixer-B/16
    }


def make_model(cfg: MixerConfig) -> nn.Module:
    return MlpMixer(cfg)


def make_inputs(cfg: MixerConfig, batch: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    return (torch.randn(batch, 3, cfg.image, cfg.image, generator=gen),)
