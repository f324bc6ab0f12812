"""Token files for `xsched train --data/--val-data`: one flat array of token ids, nanoGPT's layout (uint16 `.bin`, as
`np.array(ids, dtype=np.uint16).tofile(path)` writes it) or a 1-D integer `.npy`, read through a memmap and checked
whole before training (every id below the model's vocabulary size).

A batch is a pure function of (seed, step, rank, world), as the zoo's synthetic streams are: the step's global batch
is `world * batch` windows of `seq + 1` tokens at offsets drawn from a generator seeded by (seed, stream, step), and
rank r reads rows [r * batch, (r + 1) * batch). Window i gives inputs tokens[i : i + seq] and targets
tokens[i + 1 : i + seq + 1]. They fill a language model's batch in the example batch's layout."""

from __future__ import annotations

import zlib
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch import nn

from xsched.errors import XschedError
from xsched.loaders import Batch, TrainingTask

CHUNK = 1 << 24  # tokens checked per read: 32 MiB of uint16, so a large file is never loaded whole

LAYOUTS = "((idx, targets), None) for a model that returns its loss, or ((idx,), targets)"


def _fail(message: str) -> XschedError:
    return XschedError(message, stage="data")


def open_tokens(path: str | Path, vocab: int, seq: int) -> np.ndarray:
    """The token ids in `path` as a read-only memmap; a missing, empty or corrupt file, one shorter than one window
    of `seq + 1` tokens, or an id outside [0, vocab) is a one-line XschedError naming the file."""
    path = Path(path)
    if not path.is_file():
        raise _fail(f"token file {path} does not exist")
    if path.suffix == ".bin":
        size = path.stat().st_size
        if size == 0 or size % 2:
            raise _fail(f"token file {path} is not uint16 tokens: {size} bytes")
        tokens = np.memmap(path, dtype=np.uint16, mode="r")
    elif path.suffix == ".npy":
        try:
            tokens = np.load(path, mmap_mode="r", allow_pickle=False)
        except (OSError, ValueError, EOFError) as e:
            raise _fail(f"token file {path} is not a readable .npy array: {str(e).splitlines()[0][:160]}") from e
        if tokens.ndim != 1 or tokens.dtype.kind not in "ui":
            raise _fail(f"token file {path} holds a {tokens.ndim}-D {tokens.dtype} array; want 1-D integer token ids")
    else:
        raise _fail(f"token file {path} must be a uint16 .bin (nanoGPT's layout) or a 1-D integer .npy")
    if len(tokens) < seq + 1:
        raise _fail(f"token file {path} has {len(tokens)} tokens, fewer than one window of seq + 1 = {seq + 1}")
    _check_ids(tokens, vocab, path)
    return tokens


def _check_ids(tokens: np.ndarray, vocab: int, path: Path) -> None:
    for lo in range(0, len(tokens), CHUNK):
        part = np.asarray(tokens[lo : lo + CHUNK])
        bad = (part >= vocab) | (part < 0) if part.dtype.kind == "i" else part >= vocab
        if bad.any():
            at = lo + int(np.argmax(bad))
            raise _fail(
                f"token file {path}: token id {int(tokens[at])} at position {at} is outside the vocabulary "
                f"(the model's vocabulary size is {vocab})"
            )


def vocab_size(model: nn.Module, name: str) -> int:
    """The number of token ids `model` embeds: its input embeddings (Hugging Face) or its first nn.Embedding."""
    get = getattr(model, "get_input_embeddings", None)
    embedding = get() if callable(get) else next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    if not isinstance(embedding, nn.Embedding):
        raise _fail(f"{name}: --data needs a language model with an nn.Embedding of its tokens; found none")
    return embedding.num_embeddings


def layout(task: TrainingTask) -> tuple[str, int, int]:
    """How token windows fill `task`'s batches ("model_loss": inputs (idx, targets) and no targets, or "targets":
    inputs (idx,) and the targets for loss_fn), with the example's (batch, seq)."""
    inputs, targets = task.example_batch

    def ids(x: object) -> bool:
        return isinstance(x, torch.Tensor) and x.dim() == 2 and not x.is_floating_point() and not x.is_complex()

    if (
        len(inputs) == 2
        and targets is None
        and ids(inputs[0])
        and ids(inputs[1])
        and inputs[0].shape == inputs[1].shape
    ):
        return "model_loss", *inputs[0].shape
    if len(inputs) == 1 and ids(inputs[0]) and ids(targets) and inputs[0].shape == targets.shape:
        return "targets", *inputs[0].shape

    def describe(x: object) -> str:
        return f"{str(x.dtype).removeprefix('torch.')}{list(x.shape)}" if isinstance(x, torch.Tensor) else repr(x)

    got = f"(({', '.join(describe(x) for x in inputs)}), {describe(targets)})"
    raise _fail(f"{task.name}: --data fills a batch {LAYOUTS}, each (batch, seq) integer ids; its example is {got}")


def _seed(*parts: object) -> int:
    return zlib.crc32(":".join(map(str, parts)).encode())  # the same in every process, unlike hash()


def token_batches(tokens: np.ndarray, how: str, batch: int, seq: int, seed: int, stream: str) -> Callable[..., Batch]:
    """batches(step, rank, world): rank's rows of the step's global batch of windows (see the module docstring)."""
    span = len(tokens) - seq  # window starts 0 .. len - seq - 1: the targets' last token is the file's last

    def batches(step: int, rank: int = 0, world: int = 1) -> Batch:
        gen = torch.Generator().manual_seed(_seed(stream, seed, step))
        starts = torch.randint(0, span, (world * batch,), generator=gen)[rank * batch : (rank + 1) * batch]
        windows = np.stack([np.asarray(tokens[i : i + seq + 1]) for i in starts.tolist()]).astype(np.int64)
        window = torch.from_numpy(windows)
        x, y = window[:, :-1].contiguous(), window[:, 1:].contiguous()
        return ((x, y), None) if how == "model_loss" else ((x,), y)

    return batches


def token_data(task: TrainingTask, path: str, seed: int, stream: str) -> Callable[..., Batch]:
    """`task`'s batches from the token file at `path` (checked against its model's vocabulary)."""
    how, batch, seq = layout(task)
    tokens = open_tokens(path, vocab_size(task.model, task.name), seq)
    return token_batches(tokens, how, batch, seq, seed, stream)
