"""UNet as in the XEngine paper: conv3x3+InstanceNorm+LeakyReLU pairs, max-pool down, transposed-conv up, concatenated skips."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class UNetConfig:
    depth: int = 4  # number of down/up steps
    width: int = 64  # channels of the first encoder block; doubled at every step down
    in_channels: int = 3
    classes: int = 2
    image: int = 256  # must be divisible by 2**depth
    batch: int = 8


class ConvBlock(nn.Sequential):
    """Two (conv3x3 -> InstanceNorm -> LeakyReLU) stages."""

    def __init__(self, cin: int, cout: int) -> None:
        super().__init__(
            nn.Conv2d(cin, cout, 3, padding=1),
            nn.InstanceNorm2d(cout, affine=True),
            nn.LeakyReLU(0.01),
            nn.Conv2d(cout, cout, 3, padding=1),
            nn.InstanceNorm2d(cout, affine=True),
            nn.LeakyReLU(0.01),
        )


class UpBlock(nn.Module):
    """Upsample by a transposed conv, concatenate the encoder's skip, then a ConvBlock."""

    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.up = nn.ConvTranspose2d(cin, cout, 2, stride=2)
        self.block = ConvBlock(2 * cout, cout)

    def forward(self, x: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        return self.block(torch.cat([self.up(x), skip], dim=1))


class UNet(nn.Module):
    def __init__(self, cfg: UNetConfig) -> None:
        super().__init__()
        chans = [cfg.width * 2**i for i in range(cfg.depth + 1)]
        self.encoder = nn.ModuleList(
            ConvBlock(c_in, c_out) for c_in, c_out in zip([cfg.in_channels] + chans, chans[:-1])
        )
        self.pool = nn.MaxPool2d(2)
        self.bottleneck = ConvBlock(chans[-2], chans[-1])
        self.decoder = nn.ModuleList(UpBlock(chans[i + 1], chans[i]) for i in reversed(range(cfg.depth)))
        self.head = nn.Conv2d(chans[0], cfg.classes, 1)
        for m in self.modules():
            if isinstance(m, (nn.Conv2d, nn.ConvTranspose2d)):
                nn.init.kaiming_normal_(m.weight, a=0.01, nonlinearity="leaky_relu")
                nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skips = []
        for block in self.encoder:
            x = block(x)
            skips.append(x)
            x = self.pool(x)
        x = self.bottleneck(x)
        for up, skip in zip(self.decoder, reversed(skips)):
            x = up(x, skip)
        return self.head(x)  # per-pixel class logits, same spatial size as the image


def scales(name: str) -> dict[str, UNetConfig]:
    return {
        "tiny": UNetConfig(width=4, image=32, batch=2),
        "small": UNetConfig(width=8, image=64, batch=2),
        "default": UNetConfig(width=32, image=128, batch=4),
        "full": UNetConfig(),
    }


def make_model(cfg: UNetConfig) -> nn.Module:
    if cfg.image % 2**cfg.depth:
        raise ValueError(f"unet image side {cfg.image} is not divisible by 2**depth = {2**cfg.depth}")
    return UNet(cfg)


def make_inputs(cfg: UNetConfig, batch: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    return (torch.randn(batch, cfg.in_channels, cfg.image, cfg.image, generator=gen),)
