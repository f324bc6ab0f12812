"""VGG-16/19 (torchvision's layout without batch norm: 3x3 convs, max pools, adaptive pool, dropout classifier)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

_CONVS = {"vgg16": (2, 2, 3, 3, 3), "vgg19": (2, 2, 4, 4, 4)}  # convs per stage (configs D and E)


@dataclass(frozen=True)
class VGGConfig:
    convs: tuple[int, ...]
    width: int = 64  # stage i has min(width * 2**i, 8 * width) channels
    pool: int = 7  # adaptive pool side before the classifier; 1 lets small images through cheaply
    hidden: int = 4096
    dropout: float = 0.5
    image: int = 224
    classes: int = 1000
    batch: int = 32


class VGG(nn.Module):
    def __init__(self, cfg: VGGConfig) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        cin = 3
        for i, n in enumerate(cfg.convs):
            cout = min(cfg.width * 2**i, cfg.width * 8)
            for _ in range(n):
                layers += [nn.Conv2d(cin, cout, 3, padding=1), nn.ReLU()]
                cin = cout
            layers.append(nn.MaxPool2d(2, 2))
        self.features = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d(cfg.pool)
        self.classifier = nn.Sequential(
            nn.Linear(cin * cfg.pool * cfg.pool, cfg.hidden),
            nn.ReLU(),
            nn.Dropout(cfg.dropout),
            nn.Linear(cfg.hidden, cfg.hidden),
            nn.ReLU(),
            nn.Dropout(cfg.dropout),
            nn.Linear(cfg.hidden, cfg.classes),
        )
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
                nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, 0.0, 0.01)
                nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.avgpool(self.features(x)), 1))


def scales(name: str) -> dict[str, VGGConfig]:
    convs = _CONVS[name]
    return {
        "tiny": VGGConfig(convs, width=4, pool=1, hidden=32, image=32, classes=10, batch=2),
        "small": VGGConfig(convs, width=16, pool=1, hidden=256, image=64, classes=100, batch=4),
        "default": VGGConfig(convs, pool=2, hidden=1024, image=64, classes=100, batch=8),
        "full": VGGConfig(convs),
    }


def make_model(cfg: VGGConfig) -> nn.Module:
    return VGG(cfg)


def make_inputs(cfg: VGGConfig, batch: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    return (torch.randn(batch, 3, cfg.image, cfg.image, generator=gen),)
