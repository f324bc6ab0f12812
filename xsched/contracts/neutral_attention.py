"""Scaled dot-product attention from plain aten ops, on any device: the forward and backward of the CPU's fused
kernel (`aten._scaled_dot_product_flash_attention_for_cpu` and its `_backward`), for graphs captured on the CPU
that run elsewhere.

A CPU capture records the CPU-only kernel; CUDA's fused kernels (flash, efficient, cuDNN) take other arguments and
return other tensors (a philox seed and offset, a padded logsumexp), so a CPU-captured graph cannot be rewritten to
call them, and nothing here (no GPU) could test such a rewrite. These functions compute what the CPU kernel
computes, with its outputs' shapes, dtypes and layouts (the output laid out as the query, the logsumexp and the
gradients as its (B, L, H) / (B, S, Hk, E) buffers transposed), from matmul, exp and sums that every device has.

Transient memory is bounded by tiling: scores are made for a block of (batch, kv-head group, query rows) whose
float32 L x S slice holds at most `block_bytes` (BLOCK_BYTES by default: 64 MiB, large enough that each block's
matmuls run at a GPU's full rate, e.g. all 96 heads of GPT-2 small at T=1024 in 6 row blocks, and a small part
of the 400 MB whole score tensor). The forward holds one such block (scores, turned into probabilities in place)
beside the float32 copies of the block's rows and keys; the backward two (probabilities and their gradient) and
float32 accumulators of its group's key and value gradients. Query heads sharing a key head (GQA) are folded into
the rows, so keys and values are never repeated. A causal block reads only the keys its last row sees. The
profiler's CUDA workspace (the allocator's peak during one call, less the outputs) is this transient.

Scores, softmax and both products accumulate in float32 for half and bf16 inputs (float64 for float64), as the
fused kernels do; results are cast to the inputs' dtype once. A row whose every key is masked out gives 0 and a
logsumexp of 0, as the CPU kernel does. Dropout cannot match the CPU kernel's random stream and is refused by the
caller (contracts/device_kernels.py).
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
    r, scale_ = _check(query, key, value, dropout_p, scale)
    acc = accumulate_dtype(query.dtype)
    out = torch.empty_like(query)  # laid out as the query, as the CPU kernel's output is
    lse = torch.empty((B, L, H), dtype=acc, device=query.device).transpose(1, 2)
    mask = _mask4(attn_mask)
    for g in _groups(query, key, r, block_bytes):
        k_all, v_all = _heads(key, g).to(acc), _heads(value, g).to(acc)
        for blk in _row_blocks(g, L, key.shape[2], is_causal):
            s = _scores(_rows(query, blk, r, acc), k_all[:, :, : blk.keys], scale_, mask, blk, r, is_causal)
            top = s.amax(-1, keepdim=True)
            top.masked_fill_(top == -math.inf, 0.0)  # a row with every key masked: exp(-inf) = 0, not nan
            p = s.sub_(top).exp_()
            total = p.sum(-1, keepdim=True)
            o = (p @ v_all[:, :, : blk.keys]).div_(total.clamp_min(torch.finfo(acc).tiny))
            _put(out, blk, r, o)
            _put(lse, blk, r, top.add_(total.log()).masked_fill_(total == 0, 0.0).squeeze(-1))
    return out, lse


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
    r, scale_ = _check(query, key, value, dropout_p, scale)
    acc = accumulate_dtype(query.dtype)
    dev = query.device
    grad_q = torch.empty((B, L, H, E), dtype=query.dtype, device=dev).transpose(1, 2)
    grad_k = torch.empty((B, S, Hk, E), dtype=key.dtype, device=dev).transpose(1, 2)
    grad_v = torch.empty((B, S, Hk, E), dtype=value.dtype, device=dev).transpose(1, 2)
    mask = _mask4(attn_mask)
    for g in _groups(query, key, r, 2 * block_bytes // 3):  # two score-sized blocks live: share the budget
        k_all, v_all = _heads(key, g).to(acc), _heads(value, g).to(acc)
        dk, dv = torch.zeros_like(k_all), torch.zeros_like(v_all)
        for blk in _row_blocks(g, L, S, is_causal):
            n = blk.keys
            q, do = _rows(query, blk, r, acc), _rows(grad_out, blk, r, acc)
            rows_lse = _rows(logsumexp.unsqueeze(-1), blk, r, acc)
            delta = (do * _rows(out, blk, r, acc)).sum(-1, keepdim=True)  # rowsum(dO * O) = rowsum(dP * P)
            p = _scores(q, k_all[:, :, :n], scale_, mask, blk, r, is_causal).sub_(rows_lse).exp_()
            dv[:, :, :n] += p.transpose(-1, -2) @ do
            ds = p.mul_((do @ v_all[:, :, :n].transpose(-1, -2)).sub_(delta))
            _put(grad_q, blk, r, (ds @ k_all[:, :, :n]).mul_(scale_))
            dk[:, :, :n] += (ds.transpose(-1, -2) @ q).mul_(scale_)
        grad_k[g.b0 : g.b1, g.h0 : g.h1].copy_(dk)
        grad_v[g.b0 : g.b1, g.h0 : g.h1].copy_(dv)
    return grad_q, grad_k, grad_v


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


def _groups(query: torch.Tensor, key: torch.Tensor, r: int, block_bytes: int) -> Iterator[_Block]:
    """(batch, key head) blocks, with the row count each row block takes (in l1): whole rows where they fit, all
    batches and heads at once where one row of each fits, else fewer heads, else one head and fewer rows."""
    B, Hk, S, L = key.shape[0], key.shape[1], key.shape[2], query.shape[2]
    per_row = max(1, r * S * accumulate_dtype(query.dtype).itemsize)  # one row of one key head's group
    units = max(1, block_bytes // per_row)
    rows = min(L, max(1, units // (B * Hk)))
    heads = min(Hk, max(1, units // rows))
    batches = min(B, max(1, units // (rows * Hk))) if heads == Hk else 1
    for b0 in range(0, B, batches):
        for h0 in range(0, Hk, heads):
            yield _Block(b0, min(B, b0 + batches), h0, min(Hk, h0 + heads), 0, rows, S)


def _row_blocks(g: _Block, L: int, S: int, is_causal: bool) -> Iterator[_Block]:
    """The row blocks of group `g` (g.l1 rows each); a causal one reads the keys up to its last row (top left)."""
    for l0 in range(0, L, g.l1):
        l1 = min(L, l0 + g.l1)
        yield _Block(g.b0, g.b1, g.h0, g.h1, l0, l1, min(S, l1) if is_causal else S)


def _heads(t: torch.Tensor, g: _Block) -> torch.Tensor:
    return t[g.b0 : g.b1, g.h0 : g.h1]


def _rows(t: torch.Tensor, blk: _Block, r: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows l0:l1 of the block's query heads, as (batches, key heads, r * rows, dim) in `dtype`."""
    part = t[blk.b0 : blk.b1, blk.h0 * r : blk.h1 * r, blk.l0 : blk.l1]
    b, _, n, d = part.shape
    return part.unflatten(1, (blk.h1 - blk.h0, r)).reshape(b, blk.h1 - blk.h0, r * n, d).to(dtype)


def _put(dst: torch.Tensor, blk: _Block, r: int, src: torch.Tensor) -> None:
    """Write a block's (batches, key heads, r * rows, ...) result into `dst`'s (batch, query head, row, ...) slice."""
    part = dst[blk.b0 : blk.b1, blk.h0 * r : blk.h1 * r, blk.l0 : blk.l1]
    part.unflatten(1, (blk.h1 - blk.h0, r)).copy_(src.view(part.unflatten(1, (blk.h1 - blk.h0, r)).shape))


def _scores(
    q: torch.Tensor,
    k: torch.Tensor,
    scale: float,
    mask: torch.Tensor | None,
    blk: _Block,
    r: int,
    is_causal: bool,
) -> torch.Tensor:
    """The block's scaled scores, masked: (batches, key heads, r * rows, keys) in q's dtype."""
    s = (q @ k.transpose(-1, -2)).mul_(scale)
    s5 = s.view(s.shape[0], s.shape[1], r, blk.l1 - blk.l0, blk.keys)
    if is_causal:
        rows = torch.arange(blk.l0, blk.l1, device=s.device).unsqueeze(-1)
        s5.masked_fill_(torch.arange(blk.keys, device=s.device) > rows, -math.inf)
    if mask is not None:
        m = _mask_block(mask, blk, r)
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
