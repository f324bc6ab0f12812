"""ResNet-18/34/50 (torchvision's layout: BasicBlock / Bottleneck v1.5, batch norm, 1x1 projection shortcuts)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class ResNetConfig:
    layers: tuple[int, ...]  # blocks per stage
    bottleneck: bool
    width: int = 64  # stem channels; stage i has width * 2**i (times 4 at a bottleneck's output)
    image: int = 224
    classes: int = 1000
    batch: int = 32


def _conv(cin: int, cout: int, k: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, k, stride=stride, padding=k // 2, bias=False)


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, cin: int, planes: int, stride: int, downsample: nn.Module | None) -> None:
        super().__init__()
        self.conv1, self.bn1 = _conv(cin, planes, 3, stride), nn.BatchNorm2d(planes)
        self.conv2, self.bn2 = _conv(planes, planes, 3), nn.BatchNorm2d(planes)
        self.relu = nn.ReLU()  # not in place: keeps the captured graph free of mutation
        self.downsample = downsample

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        identity = x if self.downsample is None else self.downsample(x)
        return self.relu(out + identity)


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, cin: int, planes: int, stride: int, downsample: nn.Module | None) -> None:
        super().__init__()
        # v1.5: the stride sits on the 3x3 conv, as in torchvision
        self.conv1, self.bn1 = _conv(cin, planes, 1), nn.BatchNorm2d(planes)
        self.conv2, self.bn2 = _conv(planes, planes, 3, stride), nn.BatchNorm2d(planes)
        self.conv3, self.bn3 = _conv(planes, planes * 4, 1), nn.BatchNorm2d(planes * 4)
        self.relu = nn.ReLU()
        self.downsample = downsample

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        identity = x if self.downsample is None else self.downsample(x)
        return self.relu(out + identity)


class ResNet(nn.Module):
    def __init__(self, cfg: ResNetConfig) -> None:
        super().__init__()
        block = Bottleneck if cfg.bottleneck else BasicBlock
        w = cfg.width
        self.conv1 = nn.Conv2d(3, w, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(w)
        self.relu = nn.ReLU()
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        cin = w
        stages = []
        for i, n in enumerate(cfg.layers):
            planes, stride = w * 2**i, 1 if i == 0 else 2
            blocks = []
            for j in range(n):
                s = stride if j == 0 else 1
                down = None
                if s != 1 or cin != planes * block.expansion:
                    down = nn.Sequential(
                        _conv(cin, planes * block.expansion, 1, s), nn.BatchNorm2d(planes * block.expansion)
                    )
                blocks.append(block(cin, planes, s, down))
                cin = planes * block.expansion
            stages.append(nn.Sequential(*blocks))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, cfg.classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


_DEPTHS = {"resnet18": ((2, 2, 2, 2), False), "resnet34": ((3, 4, 6, 3), False), "resnet50": ((3, 4, 6, 3), True)}


def scales(name: str) -> dict[str, ResNetConfig]:
    layers, bottleneck = _DEPTHS[name]
    # every scale keeps the published depth and block type; only width, image and batch shrink
    return {
        "tiny": ResNetConfig(layers, bottleneck, width=4, image=32, classes=10, batch=2),
        "small": ResNetConfig(layers, bottleneck, width=16, image=64, classes=100, batch=4),
        "default": ResNetConfig(layers, bottleneck, image=64, batch=16),  # the published network on 64x64 images
        "full": ResNetConfig(layers, bottleneck),
    }


def make_model(cfg: ResNetConfig) -> nn.Module:
    return ResNet(cfg)


def make_inputs(cfg: ResNetConfig, batch: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    return (torch.randn(batch, 3, cfg.image, cfg.image, generator=gen),)
