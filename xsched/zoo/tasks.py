"""Training tasks for the zoo models: each family's loss and a deterministic synthetic data stream.

The targets come from a fixed random teacher, so a model can learn them and a training run shows its loss fall:

| family                            | batch: (inputs, targets)                     | loss                          |
|-----------------------------------|----------------------------------------------|-------------------------------|
| resnet*, vgg*, mlp_mixer          | (images,), class = argmax(channel means @ T) | cross entropy of the logits   |
| unet                              | (images,), pixel class = argmax(pixel @ T)   | per-pixel cross entropy       |
| gpt2, llama                       | (idx, targets), None: arithmetic sequences   | the model's own (logits, loss) |
| transformer                       | (src, tgt_in), tgt: the source reversed      | cross entropy per target token |

A step's data is a pure function of (seed, step): the global batch of `world * batch` rows is drawn from a
generator seeded by both, and rank r takes rows [r * batch, (r + 1) * batch). Two ranks of batch b therefore see
exactly the rows one process of batch 2b sees, and a resumed run sees what an uninterrupted one would.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from xsched.zoo import ZooError, config

Batch = tuple[tuple[torch.Tensor, ...], Any]  # (model inputs, targets for the loss)

_KIND = {
    "resnet18": "classify",
    "resnet34": "classify",
    "resnet50": "classify",
    "vgg16": "classify",
    "vgg19": "classify",
    "mlp_mixer": "classify",
    "unet": "segment",
    "gpt2": "next_token",
    "llama": "next_token",
    "transformer": "reverse",
}


def _stable(*parts: object) -> int:
    return zlib.crc32(":".join(map(str, parts)).encode())  # the same in every process, unlike hash()


def cross_entropy(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Logits (N, C) or (N, C, H, W) against class indices (N,) or (N, H, W)."""
    return F.cross_entropy(outputs, targets)


def sequence_cross_entropy(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Logits (N, T, V) against token indices (N, T)."""
    return F.cross_entropy(outputs.flatten(0, 1), targets.flatten())


def model_loss(outputs: tuple[torch.Tensor, torch.Tensor], targets: Any) -> torch.Tensor:
    """A model that computes its own loss and returns (logits, loss)."""
    return outputs[1]


_LOSS: dict[str, Callable[[Any, Any], torch.Tensor]] = {
    "classify": cross_entropy,
    "segment": cross_entropy,
    "next_token": model_loss,
    "reverse": sequence_cross_entropy,
}


def kind(name: str) -> str:
    if name not in _KIND:
        raise ZooError(f"no training task for zoo model {name!r}; known: {', '.join(sorted(_KIND))}")
    return _KIND[name]


def task_loss(name: str) -> Callable[[Any, Any], torch.Tensor]:
    """The loss `xsched train` uses for zoo model `name`: loss(outputs, targets) -> scalar."""
    return _LOSS[kind(name)]


def _teacher(name: str, rows: int, cols: int) -> torch.Tensor:
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(_stable(name, "teacher")))


def _global_batch(name: str, cfg: Any, n: int, gen: torch.Generator) -> Batch:
    """`n` rows of the task's data, drawn from `gen`."""
    k = kind(name)
    if k in ("classify", "segment"):
        channels = getattr(cfg, "in_channels", 3)
        x = torch.randn(n, channels, cfg.image, cfg.image, generator=gen)
        t = _teacher(name, channels, cfg.classes)
        if k == "classify":
            return (x,), (x.mean((2, 3)) @ t).argmax(1)
        return (x,), torch.einsum("nchw,ck->nkhw", x, t).argmax(1)
    if k == "next_token":
        return _sequences(n, cfg.vocab, cfg.seq, gen)
    src = torch.randint(1, cfg.vocab, (n, cfg.src_len), generator=gen)
    target = src.flip(1)[:, torch.arange(cfg.tgt_len) % cfg.src_len]
    tgt_in = torch.cat([torch.zeros(n, 1, dtype=src.dtype), target[:, :-1]], 1)  # teacher forcing, 0 = start
    return (src, tgt_in), target


def _sequences(n: int, vocab: int, seq: int, gen: torch.Generator) -> Batch:
    """`n` arithmetic sequences mod `vocab` (random start, stride 1-3) as next-token inputs and targets."""
    start = torch.randint(0, vocab, (n, 1), generator=gen)
    stride = torch.randint(1, 4, (n, 1), generator=gen)
    tokens = (start + stride * torch.arange(seq + 1)) % vocab
    return (tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()), None


def _rows(x: Any, lo: int, hi: int) -> Any:
    return x[lo:hi].clone() if isinstance(x, torch.Tensor) else x


def task_batch(name: str, scale: str, batch: int, step: int, rank: int = 0, world: int = 1, seed: int = 0) -> Batch:
    """Rank `rank`'s `batch` rows of step `step`'s global batch (world * batch rows) for zoo model `name`."""
    cfg = config(name, scale)
    gen = torch.Generator().manual_seed(_stable(name, seed, step))
    return _rank_rows(_global_batch(name, cfg, world * batch, gen), rank, batch)


def sequence_batch(
    name: str, vocab: int, seq: int, batch: int, step: int, rank: int = 0, world: int = 1, seed: int = 0
) -> Batch:
    """The gpt2 task's stream for any language model (`name` seeds it): rank `rank`'s `batch` rows of step `step`'s
    arithmetic sequences, ((idx, targets), None) of `seq` tokens below `vocab`."""
    gen = torch.Generator().manual_seed(_stable(name, seed, step))
    return _rank_rows(_sequences(world * batch, vocab, seq, gen), rank, batch)


def _rank_rows(global_batch: Batch, rank: int, batch: int) -> Batch:
    inputs, targets = global_batch
    lo, hi = rank * batch, (rank + 1) * batch
    return tuple(_rows(x, lo, hi) for x in inputs), _rows(targets, lo, hi)
