"""Model zoo: named, deterministic training workloads (model in train mode + example inputs) at four scales.

| name        | tiny (tests)              | small                     | default (benchmarks)         | full (published size)      |
|-------------|---------------------------|---------------------------|------------------------------|----------------------------|
| resnet18    | b2, 3x32x32, width 4      | b4, 3x64x64, width 16     | b16, 3x64x64, published net  | b32, 3x224x224, 11,689,512 |
| resnet34    | b2, 3x32x32, width 4      | b4, 3x64x64, width 16     | b16, 3x64x64, published net  | b32, 3x224x224, 21,797,672 |
| resnet50    | b2, 3x32x32, width 4      | b4, 3x64x64, width 16     | b16, 3x64x64, published net  | b32, 3x224x224, 25,557,032 |
| vgg16/19    | b2, 3x32x32, width 4      | b4, 3x64x64, width 16     | b8, 3x64x64, width 64, fc 1k | b32, 3x224x224, 138M/144M  |
| unet        | b2, 3x32x32, width 4      | b2, 3x64x64, width 8      | b4, 3x128x128, width 32      | b8, 3x256x256, width 64    |
| gpt2        | b2, T16, 2L 2H 32d V64    | b4, T64, 4L 4H 64d V256   | b8, T128, 6L 6H 192d V1024   | b8, T1024, GPT-2 124M      |
| transformer | b2, 16->16, d32 2+2L V64  | b4, 32->32, d64 2+2L V256 | b8, 64->64, d256 3+3L V1024  | b16, 128->128, base 6+6L   |
| mlp_mixer   | b2, 3x32x32, p8 d16 2L    | b4, 3x64x64, p8 d64 4L    | b16, 3x64x64, p8 d256 8L     | b32, 3x224x224, Mixer-B/16 |
| llama       | b2, T16, 2L 4H/2KV 32d    | b4, T64, 4L 4H/2KV 64d    | b8, T128, 6L 6H/2KV 192d     | b2, T1024, Llama 3.2 3B    |

Every scale keeps the architecture's block types and topology; ResNet, VGG and UNet keep their full depth at
every scale. Inputs: images (float32, N(0,1)) for the vision models; (idx, targets) int64 for gpt2, whose forward
returns (logits, loss), as llama's; (src, tgt) int64 for transformer. Other models return logits (unet: per-pixel logits).

`scale` may carry config overrides after a colon, e.g. "tiny:n_layer=4" or "default:image=96,width=16"; the
fields are those of each family's config dataclass.
"""

from __future__ import annotations

import dataclasses
import zlib
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
from torch import nn

from xsched.errors import XschedError
from xsched.zoo import gpt, llama, mixer, resnet, transformer, unet, vgg
from xsched.zoo.gpt import GPT

SCALES = ("tiny", "small", "default", "full")
_FAMILIES: dict[str, ModuleType] = {
    "resnet18": resnet,
    "resnet34": resnet,
    "resnet50": resnet,
    "vgg16": vgg,
    "vgg19": vgg,
    "unet": unet,
    "gpt2": gpt,
    "transformer": transformer,
    "mlp_mixer": mixer,
    "llama": llama,
}

__all__ = ["GPT", "SCALES", "ZooError", "ZooModel", "build", "build_module", "config", "names"]


class ZooError(XschedError, ValueError):
    """An unknown model name, scale, config override or batch size."""

    def __init__(self, message: str) -> None:
        super().__init__(message, stage="zoo")


@dataclass(frozen=True)
class ZooModel:
    name: str
    model: nn.Module
    inputs: tuple[torch.Tensor, ...]


def names() -> list[str]:
    return sorted(_FAMILIES)


def _family(name: str) -> ModuleType:
    if name not in _FAMILIES:
        raise ZooError(f"unknown model {name!r}; known: {', '.join(names())}")
    return _FAMILIES[name]


def _override(cfg: Any, name: str, text: str) -> Any:
    fields = {f.name for f in dataclasses.fields(cfg)}
    changes: dict[str, Any] = {}
    for item in filter(None, text.split(",")):
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or key not in fields:
            raise ZooError(f"bad override {item!r} for {name}; use key=value with key in {sorted(fields)}")
        old = getattr(cfg, key)
        try:
            changes[key] = tuple(int(v) for v in raw.split("x")) if isinstance(old, tuple) else type(old)(raw)
        except ValueError as e:
            raise ZooError(f"bad value {raw!r} for {name} config field {key!r} ({type(old).__name__})") from e
    return dataclasses.replace(cfg, **changes)


def config(name: str, scale: str = "default") -> Any:
    """The frozen config dataclass `build` uses for (name, scale), overrides applied."""
    base, _, overrides = scale.partition(":")
    table = _family(name).scales(name)
    if base not in table:
        raise ZooError(f"unknown scale {base!r} for {name}; known: {', '.join(SCALES)}")
    return _override(table[base], name, overrides)


def _seed(name: str) -> int:
    return zlib.crc32(name.encode())  # stable across processes, unlike hash()


def build_module(name: str, scale: str = "default", device: torch.device | str | None = None) -> nn.Module:
    """Only the model, in train mode; device="meta" builds it without memory (for parameter counts)."""
    cfg = config(name, scale)
    # Modules initialise from the global RNG: seed a forked copy so weights are reproducible and the caller's
    # RNG stream is left exactly as it was.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(_seed(name))
        try:
            with torch.device(device or "cpu"):
                model = _family(name).make_model(cfg)
        except ValueError as e:
            raise ZooError(f"cannot build {name} at scale {scale!r}: {e}") from e
    return model.train()


def build(name: str, batch: int | None = None, scale: str = "default") -> ZooModel:
    """Model `name` in train mode with deterministic weights and example inputs at `scale`; `batch` overrides."""
    cfg = config(name, scale)
    if batch is None:
        batch = cfg.batch
    if not isinstance(batch, int) or isinstance(batch, bool) or batch < 1:
        raise ZooError(f"batch must be a positive int, got {batch!r} for {name}")
    model = build_module(name, scale)
    gen = torch.Generator().manual_seed(_seed(name) + 1)
    inputs = _family(name).make_inputs(cfg, batch, gen)
    return ZooModel(name, model, tuple(inputs))
