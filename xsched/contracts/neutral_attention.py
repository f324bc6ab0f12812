"""Scaled dot-product attention from plain aten ops, on any device: the forward and backward of the CPU's fused
kernel (`aten._scaled_dot_product_flash_attention_for_cpu` and its `_backward`), for graphs captured on the CPU
that run elsewhere.

A CPU capture records the CPU-only kernel; CUDA's fused kernels (flash, efficient, cuDNN) take other arguments and
return other tensors (a philox seed and offset, a padded logsumexp), so a CPU-captured graph cannot be rewritten to
call them, and nothing here (no GPU) could test such a rewrite. These functions compute what the CPU kernel
computes, with its outputs' shapes, dtypes and layouts (the output laid out as the query, the logsumexp and the
gradients as its (B, L, H) / (B, S, Hk, E) buffers transposed), from matmul, exp and sums that every device has.

Transient memory is bounded by tiling: scores are made for a block of (batches, key heads, query rows) whose
float32 scores hold at most `block_bytes` (BLOCK_BYTES by default: 64 MiB, so each block is a few large batched
matmuls, e.g. all 96 heads of GPT-2 small at T=1024 in 6 row blocks of 170 rows, a sixth of its whole 384 MiB
score tensor; not tuned on a GPU, none here). The forward holds one block of scores (turned into probabilities in place), the backward two of
half a block (probabilities and their gradient); beside them the group's keys and values as contiguous float32
(and in the backward their float32 gradient sums), at most one block, made once per group; so the transient stays
under about two blocks (measured: 1.8 for GPT-2 small's forward, 1.9 for its backward). Query heads sharing a
key head (GQA) are folded into the rows, so keys and values are never repeated; a causal block reads only the keys
its last row sees. The profiler's CUDA workspace (the allocator's peak during one call, less the outputs) is this
transient.

Scores, softmax and both products accumulate in float32 for half and bf16 inputs (float64 for float64), as the
fused kernels do; results are cast to the inputs' dtype once. A row whose every key is masked out gives 0 and a
logsumexp of 0, as the CPU kernel does. Dropout is refused by the caller (contracts/device_kernels.py): no
stand-in draws a kernel's random mask.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch

BLOCK_BYTES = 64 << 20  # the float32 scores of one block: the unit of the transient (module docstring)


@dataclass(frozen=True)
class _Block:
    """One tile: batches b0:b1, key heads h0:h1 (query heads h0*r : h1*r), query rows l0:l1, keys 0:keys."""

    b0: int
    b1: int
    h0: int
    h1: int
    l0: int
    l1: int
    keys: int


def accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    """What the fused kernels accumulate in (and keep the logsumexp in): float64 for float64, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclass(frozen=True)
class _Call:
    """One call's arguments as the blocks read them: r query heads per key head, the accumulation dtype."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    mask: torch.Tensor | None
    scale: float
    is_causal: bool
    r: int
    acc: torch.dtype


def attention_forward(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    *,
    attn_mask: torch.Tensor | None = None,
    scale: float | None = None,
    block_bytes: int = BLOCK_BYTES,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, logsumexp) as `_scaled_dot_product_flash_attention_for_cpu` returns them; `dropout_p` must be 0."""
    B, H, L, _ = query.shape
    c = _call(query, key, value, dropout_p, is_causal, attn_mask, scale)
    out = torch.empty_like(query)  # laid out as the query, as the CPU kernel's output is
    lse = torch.empty((B, L, H), dtype=c.acc, device=query.device).transpose(1, 2)
    for g in _groups(c, block_bytes, block_bytes, 2):
        _forward_group(c, g, out, lse)
    return out, lse


def _forward_group(c: _Call, g: _Block, out: torch.Tensor, lse: torch.Tensor) -> None:
    # one function per group and per block: the last one's tensors are gone before the next one's are made
    k_all, v_all = _heads(c.key, g, c.acc), _heads(c.value, g, c.acc)
    for blk in _row_blocks(g, c.query.shape[2], c.key.shape[2], c.is_causal):
        _forward_block(c, blk, k_all[:, :, : blk.keys], v_all[:, :, : blk.keys], out, lse)


def _forward_block(
    c: _Call, blk: _Block, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor
) -> None:
    s = _scores(c, blk, _rows(c.query, blk, c.r, c.acc), k)
    top = s.amax(-1, keepdim=True)
    top.masked_fill_(top == -math.inf, 0.0)  # a row with every key masked: exp(-inf) = 0, not nan
    p = s.sub_(top).exp_()
    total = p.sum(-1, keepdim=True)
    _put(out, blk, c.r, (p @ v).div_(total.clamp_min(torch.finfo(c.acc).tiny)))
    _put(lse, blk, c.r, top.add_(total.log()).masked_fill_(total == 0, 0.0).squeeze(-1))


def attention_backward(
    grad_out: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    logsumexp: torch.Tensor,
    dropout_p: float,
    is_causal: bool,
    *,
    attn_mask: torch.Tensor | None = None,
    scale: float | None = None,
    block_bytes: int = BLOCK_BYTES,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(grad_query, grad_key, grad_value) as `_scaled_dot_product_flash_attention_for_cpu_backward` returns them,
    from the forward's output and logsumexp; `dropout_p` must be 0."""
    B, H, L, E = query.shape
    _, Hk, S, _ = key.shape
    c = _call(query, key, value, dropout_p, is_causal, attn_mask, scale)
    dev = query.device
    grads = (
        torch.empty((B, L, H, E), dtype=query.dtype, device=dev).transpose(1, 2),
        torch.empty((B, S, Hk, E), dtype=key.dtype, device=dev).transpose(1, 2),
        torch.empty((B, S, Hk, E), dtype=value.dtype, device=dev).transpose(1, 2),
    )
    for g in _groups(c, block_bytes // 2, block_bytes, 4):  # two score-sized tensors live at once
        _backward_group(c, g, grad_out, out, logsumexp, grads)
    return grads


def _backward_group(
    c: _Call, g: _Block, grad_out: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, grads: tuple[torch.Tensor, ...]
) -> None:
    k_all, v_all = _heads(c.key, g, c.acc), _heads(c.value, g, c.acc)
    dk, dv = torch.zeros_like(k_all), torch.zeros_like(v_all)  # summed over the row blocks in float32
    for blk in _row_blocks(g, c.query.shape[2], c.key.shape[2], c.is_causal):
        n = blk.keys
        _backward_block(
            c, blk, grad_out, out, lse, grads[0], (k_all[:, :, :n], v_all[:, :, :n], dk[:, :, :n], dv[:, :, :n])
        )
    grads[1][g.b0 : g.b1, g.h0 : g.h1].copy_(dk)
    grads[2][g.b0 : g.b1, g.h0 : g.h1].copy_(dv)


def _backward_block(
    c: _Call,
    blk: _Block,
    grad_out: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    grad_q: torch.Tensor,
    kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
) -> None:
    k, v, dk, dv = kv
    q, do = _rows(c.query, blk, c.r, c.acc), _rows(grad_out, blk, c.r, c.acc)
    delta = (do * _rows(out, blk, c.r, c.acc)).sum(-1, keepdim=True)  # rowsum(dO * O) = rowsum(dP * P)
    p = _scores(c, blk, q, k).sub_(_rows(lse.unsqueeze(-1), blk, c.r, c.acc)).exp_()
    dv += p.transpose(-1, -2) @ do
    ds = p.mul_((do @ v.transpose(-1, -2)).sub_(delta))
    _put(grad_q, blk, c.r, (ds @ k).mul_(c.scale))
    dk += (ds.transpose(-1, -2) @ q).mul_(c.scale)


def _call(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    dropout_p: float,
    is_causal: bool,
    attn_mask: torch.Tensor | None,
    scale: float | None,
) -> _Call:
    r, scale_ = _check(query, key, value, dropout_p, scale)
    return _Call(query, key, value, _mask4(attn_mask), scale_, is_causal, r, accumulate_dtype(query.dtype))


def _check(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, dropout_p: float, scale: float | None
) -> tuple[int, float]:
    """The query heads per key head and the scale; a shape the CPU kernel would misread is refused."""
    if dropout_p > 0.0:  # the caller refuses it with the op and device named; this is the last guard
        raise ValueError(f"dropout_p={dropout_p}: attention dropout cannot run outside the CPU kernel")
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        raise ValueError(f"query, key and value must be 4-D (batch, heads, length, dim), got {query.dim()}-D")
    B, H, _, E = query.shape
    Bk, Hk, S, Ek = key.shape
    if tuple(value.shape) != (Bk, Hk, S, Ek) or Bk != B or Ek != E or H % Hk:
        raise ValueError(
            f"query {tuple(query.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)}: key and value need "
            "the query's batch and head size, and a number of heads dividing the query's"
        )
    return H // Hk, scale if scale is not None else 1.0 / math.sqrt(E)


def _mask4(mask: torch.Tensor | None) -> torch.Tensor | None:
    """The mask as 4-D (batch, query heads, rows, keys), each dim its own size or 1 (broadcast); 2-D is (L, S)."""
    if mask is None or mask.dim() == 4:
        return mask
    if mask.dim() == 2:
        return mask.view(1, 1, *mask.shape)
    raise ValueError(f"attn_mask of {mask.dim()} dims: the CPU kernel takes 2 or 4")


def _groups(c: _Call, score_bytes: int, copy_bytes: int, copies: int) -> Iterator[_Block]:
    """(batch, key head) groups, each with the rows its row blocks take (in l1): as many (batch, key head) pairs as
    one row of each fits `score_bytes` of scores and their `copies` key-sized float32 tensors (keys and values,
    and in the backward their gradients) fit `copy_bytes`; as many rows as then fit, whole sequences if they do."""
    B, Hk, S, E, L, r = *c.key.shape, c.query.shape[2], c.r
    batches, heads, rows = _group_dims(B, Hk, S, E, L, r, c.acc.itemsize, score_bytes, copy_bytes, copies)
    for b0 in range(0, B, batches):
        for h0 in range(0, Hk, heads):
            yield _Block(b0, min(B, b0 + batches), h0, min(Hk, h0 + heads), 0, rows, S)


def _group_dims(
    B: int, Hk: int, S: int, E: int, L: int, r: int, size: int, score_bytes: int, copy_bytes: int, copies: int
) -> tuple[int, int, int]:
    """A group's batches, key heads and rows per block (see `_groups`), from the shapes alone."""
    units = max(1, score_bytes // (r * S * size))  # (pair, row) units: one row of one key head's query heads
    pairs = max(1, min(B * Hk, units, copy_bytes // (copies * S * E * size)))
    rows = min(L, max(1, units // pairs))
    heads = min(Hk, pairs)
    batches = max(1, pairs // Hk) if heads == Hk else 1
    return batches, heads, rows


def transient_bytes(
    query_shape: tuple[int, ...],
    key_shape: tuple[int, ...],
    dtype: torch.dtype,
    backward: bool,
    block_bytes: int = BLOCK_BYTES,
) -> int:
    """An upper bound on what the forward (or `backward`) allocates beside its inputs and outputs, from the shapes
    alone (a device without the kernel profiles this as the op's workspace; a modelled profile has no other way to
    see it). Per group: its keys and values in the accumulation dtype (and in the backward their gradient sums);
    per block, every tensor a block makes, as if all lived at once with every key read: rows of the query (and in
    the backward of the output and its gradient, their product, two results of rows x dim), one score-sized tensor
    (two in the backward), a bool mask of the scores, and per-row statistics."""
    B, H, L, E = query_shape
    _, Hk, S, _ = key_shape
    r, size = H // Hk, accumulate_dtype(dtype).itemsize
    score, copies = (block_bytes // 2, 4) if backward else (block_bytes, 2)
    batches, heads, rows = _group_dims(B, Hk, S, E, L, r, size, score, block_bytes, copies)
    pairs = batches * heads
    kv = pairs * S * E * size  # one of the group's key-sized tensors
    a = pairs * r * rows * E * size  # one query-rows tensor
    p = pairs * r * rows * S * size  # one score-sized tensor
    stats = 8 * pairs * r * rows * size  # row maxima, sums, their logs and comparisons
    if backward:
        return 5 * kv + 6 * a + 2 * p + p // size + stats
    return 2 * kv + 3 * a + p + p // size + stats


def _row_blocks(g: _Block, L: int, S: int, is_causal: bool) -> Iterator[_Block]:
    """The row blocks of group `g` (g.l1 rows each); a causal one reads the keys up to its last row (top left)."""
    for l0 in range(0, L, g.l1):
        l1 = min(L, l0 + g.l1)
        yield _Block(g.b0, g.b1, g.h0, g.h1, l0, l1, min(S, l1) if is_causal else S)


def _heads(t: torch.Tensor, g: _Block, dtype: torch.dtype) -> torch.Tensor:
    """The group's keys or values in `dtype`, contiguous: copied once for all its row blocks (which then multiply
    them without a copy each: a transposed (B, S, H, E) buffer's heads do not fold into one batch dim)."""
    part = t[g.b0 : g.b1, g.h0 : g.h1]
    if part.dtype == dtype and part.is_contiguous():
        return part
    return torch.empty(part.shape, dtype=dtype, device=part.device).copy_(part)  # one copy, cast and laid out


def _rows(t: torch.Tensor, blk: _Block, r: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows l0:l1 of the block's query heads, as (batches, key heads, r * rows, dim) in `dtype`."""
    part = t[blk.b0 : blk.b1, blk.h0 * r : blk.h1 * r, blk.l0 : blk.l1]
    b, _, n, d = part.shape
    return part.unflatten(1, (blk.h1 - blk.h0, r)).reshape(b, blk.h1 - blk.h0, r * n, d).to(dtype)


def _put(dst: torch.Tensor, blk: _Block, r: int, src: torch.Tensor) -> None:
    """Write a block's (batches, key heads, r * rows, ...) result into `dst`'s (batch, query head, row, ...) slice."""
    part = dst[blk.b0 : blk.b1, blk.h0 * r : blk.h1 * r, blk.l0 : blk.l1]
    part.unflatten(1, (blk.h1 - blk.h0, r)).copy_(src.view(part.unflatten(1, (blk.h1 - blk.h0, r)).shape))


def _scores(c: _Call, blk: _Block, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """The block's scaled scores, masked: (batches, key heads, r * rows, keys) in q's dtype."""
    s = (q @ k.transpose(-1, -2)).mul_(c.scale)
    s5 = s.view(s.shape[0], s.shape[1], c.r, blk.l1 - blk.l0, blk.keys)
    if c.is_causal:
        rows = torch.arange(blk.l0, blk.l1, device=s.device).unsqueeze(-1)
        s5.masked_fill_(torch.arange(blk.keys, device=s.device) > rows, -math.inf)
    if c.mask is not None:
        m = _mask_block(c.mask, blk, c.r)
        if m.dtype == torch.bool:
            s5.masked_fill_(~m, -math.inf)
        else:
            s5.add_(m)
    return s


def _mask_block(mask: torch.Tensor, blk: _Block, r: int) -> torch.Tensor:
    """The block's part of a 4-D mask, broadcastable to (batches, key heads, r, rows, keys)."""
    mb, mh, ml, ms = mask.shape
    whole = slice(None)
    m = mask[
        slice(blk.b0, blk.b1) if mb > 1 else whole,
        slice(blk.h0 * r, blk.h1 * r) if mh > 1 else whole,
        slice(blk.l0, blk.l1) if ml > 1 else whole,
        slice(0, blk.keys) if ms > 1 else whole,
    ]
    return m.unflatten(1, (blk.h1 - blk.h0, r)) if mh > 1 else m.unsqueeze(2)
