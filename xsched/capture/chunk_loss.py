"""Chunked cross-entropy: a captured graph's log_softmax + nll_loss (and its backward) split into row blocks."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch

from xsched.capture.loss_pattern import LossPattern, Ref, find_cross_entropy
from xsched.contracts.graph import Graph, Op, Value
from xsched.contracts.torch_ops import dtype_name, iter_refs, laid_out, run_op
from xsched.errors import GraphError, XschedError

_SLICE = "aten.slice.Tensor"
_SUM = 2  # torch's Reduction enum as nll_loss takes it
_NARROW = ("bfloat16", "float16")  # a weight gradient of these dtypes may be summed over the chunks in float32
_F32 = {"dtype": "float32"}
# How the chunks' weight gradients of a narrow dtype are summed. "per_chunk" (the default, as chunked linear-loss
# kernels do): in the gradient's own dtype, one rounding per chunk (within 2**-7 of its scale), at bf16 speed.
# "float32": eager's rounding at no more memory at the graph's eager peak or bound, but both factors cast up, so the
# matmuls run in float32, which a GPU does far slower than bf16 (12 ms, 20%, more per step for GPT-2 124M in the
# measured H100 model, BENCHMARKS section 20): chunking is asked for to train faster within memory.
WEIGHT_GRAD_SUMS = ("per_chunk", "float32")


def chunk_cross_entropy(graph: Graph, chunks: int, weight_grad_sum: str = "per_chunk") -> Graph:
    """`graph` with its cross-entropy computed in `chunks` row blocks (sizes differ by at most one, the last ones
    shorter), extended through the backward to the logits' matmul, so that no [rows, vocab] tensor other than the
    logits is made whole (nor the logits, where only the loss reads them: a model returning its loss alone). The
    graph is returned unchanged when it has no _log_softmax read by nll_loss_forward (directly, or cast to float32
    as `xsched train`'s bf16 autocast captures it); a pattern that differs from the captured one (see
    loss_pattern.LossPattern) is a one-line GraphError naming the op. `weight_grad_sum`: how a bf16 or fp16 weight
    gradient is summed over the chunks (WEIGHT_GRAD_SUMS)."""
    if weight_grad_sum not in WEIGHT_GRAD_SUMS:
        raise GraphError(f"weight_grad_sum must be one of {', '.join(WEIGHT_GRAD_SUMS)}, got {weight_grad_sum!r}")
    p = find_cross_entropy(graph)
    if p is None:
        return graph
    if not isinstance(chunks, int) or isinstance(chunks, bool) or not 1 <= chunks <= p.rows:
        raise GraphError(f"chunks must be an int from 1 to {p.rows} (the loss's rows), got {chunks!r}", op=p.ls.id)
    return _rewrite(graph, p, _bounds(p.rows, chunks), weight_grad_sum == "float32")


def chunked_as_asked(graph: Graph, chunks: int | None) -> Graph:
    """`graph` with its cross-entropy in `chunks` row blocks where a caller asked for them (`--chunk-loss`,
    `wrap(chunk_loss=)`): None leaves it as it is; a graph without a cross-entropy is a GraphError, since the
    rewrite asked for would not happen."""
    if chunks is None:
        return graph
    chunked = chunk_cross_entropy(graph, chunks)
    if chunked is graph:
        raise GraphError("chunk_loss: the graph has no cross-entropy (a _log_softmax read by nll_loss_forward)")
    return chunked


def _bounds(rows: int, chunks: int) -> list[tuple[int, int]]:
    q, r = divmod(rows, chunks)
    sizes = [q + 1] * r + [q] * (chunks - r)
    starts = [sum(sizes[:c]) for c in range(chunks)]
    return [(s, s + n) for s, n in zip(starts, sizes)]


# ---- building ----
class _Builder:
    """New ops and values, each output's shape, dtype and layout taken from running the op on "meta"."""

    def __init__(self, graph: Graph) -> None:
        self.graph = graph
        self.values: dict[str, Value] = {}
        self.ops: list[Op] = []
        self.next_v = _next_number(v.id for v in graph.values)
        self.next_op = _next_number(o.id for o in graph.ops)

    def emit(
        self, target: str, args: list[Any], like: Op, phase: str, keep: Sequence[str] = (), **kwargs: Any
    ) -> list[Ref]:
        """Run `target` on meta; its outputs as refs (`keep`: reuse these existing value ids, in order)."""
        inputs = tuple(dict.fromkeys(r["ref"] for r in iter_refs(args)))
        env = {v: self._tensor(v) for v in inputs}
        probe = Op("probe", target, inputs, (), phase, call={"args": args, "kwargs": kwargs, "outs": [[]]})
        try:
            result = run_op(probe, env, "meta")[0]
        except XschedError as e:
            raise GraphError(f"chunked {target} does not run: {e.detail}", op=like.id) from e
        results = list(result) if isinstance(result, (tuple, list)) else [result]
        outs = [[i] for i in range(len(results))] if isinstance(result, (tuple, list)) else [[]]
        ids = []
        for i, t in enumerate(results):
            vid = keep[i] if i < len(keep) else self._new_value_id()
            self._define(vid, t, like)
            ids.append(vid)
        op_id = f"op{self.next_op}"
        self.next_op += 1
        call = {"args": args, "kwargs": kwargs, "outs": outs}
        self.ops.append(Op(op_id, target, inputs, tuple(ids), phase, like.name, 0, call, {"node": f"chunk_{op_id}"}))
        return [{"ref": v} for v in ids]

    def _new_value_id(self) -> str:
        self.next_v += 1
        return f"v{self.next_v - 1}"

    def _define(self, vid: str, t: torch.Tensor, like: Op) -> None:
        nbytes, dtype = t.numel() * t.element_size(), dtype_name(t.dtype)
        stride = None if t.is_contiguous() else tuple(t.stride())
        old = self.graph.value.get(vid)
        if old is None:
            self.values[vid] = Value(vid, nbytes, "activation", tuple(t.shape), dtype, stride=stride)
        elif (old.nbytes, old.shape, old.dtype, old.stride) != (nbytes, tuple(t.shape), dtype, stride):
            raise GraphError(f"chunked result {list(t.shape)} {dtype} differs from {vid}'s", op=like.id, value=vid)

    def _tensor(self, vid: str) -> torch.Tensor:
        v = self.values.get(vid) or self.graph.value[vid]
        return laid_out(v, lambda n, dt: torch.empty(n, dtype=dt, device="meta"))[1]


def _next_number(ids: Sequence[str] | Any) -> int:
    nums = [int(m.group(1)) for i in ids if (m := re.fullmatch(r"[a-z]+(\d+)", i))]
    return max(nums, default=-1) + 1


def _rows(ref: Ref, start: int, end: int) -> Ref:
    return {"ref": ref["ref"], "view": [*ref.get("view", []), [_SLICE, [0, start, end]]]}


def _cast(b: _Builder, cast: Op | None, ref: Ref) -> Ref:
    """`ref` cast as `cast` (the pattern's autocast _to_copy) casts its input; `ref` itself when there is none."""
    if cast is None:
        return ref
    return b.emit(cast.target, [ref], cast, cast.phase, **dict((cast.call or {}).get("kwargs", {})))[0]


def _logits_rows(b: _Builder, p: LossPattern, start: int, end: int) -> Ref:
    """Rows start:end of the logits: a slice of X, or (X made by nothing else's mm) their own mm of H's rows."""
    if p.x_mm is None:
        return _rows(p.x_ref, start, end)
    h, w_t = p.x_mm.call["args"]
    return b.emit(p.x_mm.target, [_rows(h, start, end), w_t], p.x_mm, p.x_mm.phase)[0]


def _forward(b: _Builder, p: LossPattern, bounds: list[tuple[int, int]]) -> list[Ref]:
    """TW from the targets alone; per chunk A_c and its summed loss; L = sum / TW. Returns the A_c, TW_c refs."""
    tw = p.nll.outputs[1]
    ne = b.emit("aten.ne.Scalar", [p.t_ref, p.ignore], p.nll, p.nll.phase)
    dtype = {"dtype": b.graph.value[tw].dtype}
    b.emit("aten.sum.dim_IntList", [ne[0], [0], False], p.nll, p.nll.phase, [tw], dtype=dtype)
    kept, sums = [], []
    for s, e in bounds:
        a_c = b.emit("aten._log_softmax.default", [_logits_rows(b, p, s, e), p.dim, False], p.ls, p.ls.phase)[0]
        a_loss = _cast(b, p.cast_f, a_c)
        args = [a_loss, _rows(p.t_ref, s, e), None, _SUM, p.ignore]
        s_c, tw_c = b.emit("aten.nll_loss_forward.default", args, p.nll, p.nll.phase)
        kept.append((a_c, a_loss, tw_c))
        sums.append(s_c if not sums else b.emit("aten.add.Tensor", [sums[-1], s_c], p.nll, p.nll.phase)[0])
    b.emit("aten.div.Tensor", [sums[-1], {"ref": tw}], p.nll, p.nll.phase, [p.nll.outputs[0]])
    return kept


def _backward(b: _Builder, p: LossPattern, bounds: list[tuple[int, int]], kept: list[Any], sum_fp32: bool) -> None:
    """g' = g1 / TW; per chunk G_c, D_c, R_c (+ the logits' tangent rows), dW accumulated, dH_c; dH = cat. With
    `sum_fp32`, a narrow dW is accumulated in float32 over several chunks and cast to its dtype after them."""
    (dw,), (dh,) = p.mm_dw.outputs, p.mm_dh.outputs
    g = b.emit("aten.div.Tensor", [p.g1_ref, {"ref": p.nll.outputs[1]}], p.nllb, p.nllb.phase)[0]
    dw_ref, dh_parts = None, []
    dw_dtype = b.graph.value[dw].dtype
    in_fp32 = sum_fp32 and len(bounds) > 1 and dw_dtype in _NARROW
    for c, (s, e) in enumerate(bounds):
        a_c, a_loss, tw_c = kept[c]
        args = [g, a_loss, _rows(p.t_ref, s, e), None, _SUM, p.ignore, tw_c]
        g_c = _cast(b, p.cast_b, b.emit("aten.nll_loss_backward.default", args, p.nllb, p.nllb.phase)[0])
        dtype = {"dtype": b.graph.value[p.ls.outputs[0]].dtype}
        r_c = b.emit("aten._log_softmax_backward_data.default", [g_c, a_c, p.dim, dtype], p.lsb, p.lsb.phase)[0]
        if p.add is not None:
            pair = [_rows(p.tangent_ref, s, e), r_c] if p.tangent_first else [r_c, _rows(p.tangent_ref, s, e)]
            r_c = b.emit("aten.add.Tensor", pair, p.add, p.add.phase)[0]
        keep = [dw] if c == len(bounds) - 1 and not in_fp32 else []
        dw_ref = _add_dw_rows(b, p, dw_ref, r_c, _rows(p.h_ref, s, e), in_fp32, keep)
        dh_parts.append(b.emit("aten.mm.default", [r_c, p.w_ref], p.mm_dh, p.mm_dh.phase)[0])
    if in_fp32:  # the sum rounded to dW's dtype once, as eager's one matmul rounds it
        b.emit("aten._to_copy.default", [dw_ref], p.mm_dw, p.mm_dw.phase, [dw], dtype={"dtype": dw_dtype})
    if len(dh_parts) == 1:  # one chunk: its dH is the whole one; copy into the kept id
        b.emit("aten.clone.default", [dh_parts[0]], p.mm_dh, p.mm_dh.phase, [dh])
    else:
        b.emit("aten.cat.default", [dh_parts, 0], p.mm_dh, p.mm_dh.phase, [dh])


def _add_dw_rows(
    b: _Builder, p: LossPattern, dw_ref: Ref | None, r_c: Ref, h_c: Ref, in_fp32: bool, keep: Sequence[str]
) -> Ref:
    """dW so far (None before the first chunk) plus R_c^T H_c, into the `keep` ids. `in_fp32`: both factors are cast
    to float32 first; their products are exact there (a bf16 or fp16 product fits float32's mantissa), so the
    chunks are summed in float32 as eager's single matmul accumulates, to be rounded once after the loop."""
    if in_fp32:
        r_c, h_c = (b.emit("aten._to_copy.default", [x], p.mm_dw, p.mm_dw.phase, dtype=_F32)[0] for x in (r_c, h_c))
    r_t = {"ref": r_c["ref"], "view": [["aten.t.default", []]]}
    if dw_ref is None:
        return b.emit("aten.mm.default", [r_t, h_c], p.mm_dw, p.mm_dw.phase, keep)[0]
    return b.emit("aten.addmm.default", [dw_ref, r_t, h_c], p.mm_dw, p.mm_dw.phase, keep)[0]


def _rewrite(graph: Graph, p: LossPattern, bounds: list[tuple[int, int]], sum_fp32: bool) -> Graph:
    """The graph with the pattern's ops replaced: the forward block where the log_softmax was, the backward block
    where the first of the two mm was (every reader of dW and dH comes after it)."""
    b = _Builder(graph)
    pattern = (p.x_mm, p.ls, p.cast_f, p.nll, p.nllb, p.cast_b, p.lsb, p.add, p.mm_dw, p.mm_dh)
    removed = {o.id for o in pattern if o is not None}
    first_mm = min(graph.op_index[p.mm_dw.id], graph.op_index[p.mm_dh.id])
    ops: list[Op] = []
    kept: list[Any] = []
    for i, o in enumerate(graph.ops):
        if o.id == p.ls.id:
            start = len(b.ops)
            kept = _forward(b, p, bounds)
            ops += b.ops[start:]
        elif i == first_mm:
            start = len(b.ops)
            _backward(b, p, bounds, kept, sum_fp32)
            ops += b.ops[start:]
        if o.id not in removed:
            ops.append(o)
    gone = {v for o in (p.x_mm, p.ls, p.cast_f, p.lsb, p.nllb, p.cast_b, p.add) if o is not None for v in o.outputs}
    values = [v for v in graph.values if v.id not in gone] + list(b.values.values())
    extra = {**graph.extra, "chunk_loss": len(bounds)}
    return replace(graph, values=tuple(values), ops=tuple(ops), extra=extra)
