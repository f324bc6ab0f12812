"""Chunked cross-entropy: a captured graph's log_softmax + nll_loss (and its backward) split into row blocks."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from xsched.contracts.graph import Graph, Op, Value
from xsched.contracts.torch_ops import apply_view, dtype_name, iter_refs, laid_out, run_op
from xsched.errors import GraphError, XschedError

Ref = dict[str, Any]
_SLICE = "aten.slice.Tensor"
_DETACH = {"aten.detach.default", "aten.alias.default"}
_CAST_KWARGS = {"dtype", "layout", "device"}
_MEAN, _SUM = 1, 2  # torch's Reduction enum as nll_loss takes it


@dataclass(frozen=True)
class _Pattern:
    """The matched ops of one cross-entropy and the refs its chunks read."""

    ls: Op  # A = _log_softmax(X rows)                                        (loss)
    nll: Op  # (L, TW) = nll_loss_forward(A, T, None, mean, ignore)           (loss)
    nllb: Op  # G = nll_loss_backward(g1, A, T, None, mean, ignore, TW)       (bwd)
    lsb: Op  # D = _log_softmax_backward_data(G, A, dim, dtype)               (bwd)
    cast_f: Op | None  # autocast: A cast to float32 before the nll (it reads the cast, not A)
    cast_b: Op | None  # autocast: G cast back to A's dtype before the log_softmax backward
    add: Op | None  # R = add(tangent of the logits, view(D)), or R = D when absent
    mm_dw: Op  # dW = mm(t(R rows), H rows)
    mm_dh: Op  # dH = mm(R rows, W)
    rows: int
    x_ref: Ref  # X's rows as [N, V]
    t_ref: Ref  # the targets as [N]
    g1_ref: Ref  # the loss's incoming gradient
    ignore: int
    dim: int
    tangent_ref: Ref | None  # the logits' tangent as [N, V] (with add)
    tangent_first: bool  # the add's argument order, kept
    h_ref: Ref  # dW's right factor as [N, C]
    w_ref: Ref  # dH's right factor


def chunk_cross_entropy(graph: Graph, chunks: int) -> Graph:
    """`graph` with its cross-entropy computed in `chunks` row blocks (sizes differ by at most one, the last ones
    shorter), extended through the backward to the logits' matmul, so that no [rows, vocab] tensor other than the
    logits is made whole. The graph is returned unchanged when it has no _log_softmax read by nll_loss_forward
    (directly, or cast to float32 as `xsched train`'s bf16 autocast captures it); a pattern that differs from the
    captured one (see `_Pattern`) is a one-line GraphError naming the op."""
    found = [o for o in graph.ops if o.target == "aten._log_softmax.default" and _feeds_nll(graph, o.outputs[0])]
    if not found:
        return graph
    if len(found) > 1:
        raise GraphError(f"{len(found)} cross-entropies; chunking handles one", op=found[1].id)
    p = _match(graph, found[0])
    if not isinstance(chunks, int) or isinstance(chunks, bool) or not 1 <= chunks <= p.rows:
        raise GraphError(f"chunks must be an int from 1 to {p.rows} (the loss's rows), got {chunks!r}", op=p.ls.id)
    return _rewrite(graph, p, _bounds(p.rows, chunks))


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


# ---- matching ----
def _feeds_nll(graph: Graph, vid: str) -> bool:
    """nll_loss_forward reads `vid`, directly or cast (autocast computes the loss in float32)."""
    readers = [graph.op[c] for c in graph.consumers[vid]]
    if any(o.target == "aten.nll_loss_forward.default" for o in readers):
        return True
    casts = [o.outputs[0] for o in readers if o.target == "aten._to_copy.default"]
    return any(graph.op[c].target == "aten.nll_loss_forward.default" for v in casts for c in graph.consumers[v])


def _meta(graph: Graph, ref: Ref) -> torch.Tensor:
    """The tensor a ref names, on "meta" (shapes, strides, no data)."""
    _, t = laid_out(graph.value[ref["ref"]], lambda n, dt: torch.empty(n, dtype=dt, device="meta"))
    return apply_view(t, ref.get("view", ()))


def _is_rows(t: torch.Tensor, shape: Sequence[int]) -> bool:
    """`t` is `shape`, contiguous: rows in the order of the base's memory."""
    return tuple(t.shape) == tuple(shape) and t.is_contiguous()


def _only(graph: Graph, vid: str, readers: set[str], op: Op) -> None:
    """`vid` is read by exactly `readers` and is no output of the graph (chunking removes it)."""
    got = set(graph.consumers[vid])
    if got != readers:
        extra = sorted(got - readers) or sorted(readers - got)
        raise GraphError(f"{op.target} output {vid} has other readers than the chunked loss: {extra}", op=op.id)
    if vid in graph.outputs or vid in _role_refs(graph):
        raise GraphError(f"{op.target} output {vid} is a graph output; chunking would remove it", op=op.id)


def _role_refs(graph: Graph) -> set[str]:
    """Value ids the training roles name (forward outputs, gradients, buffer updates)."""
    refs = list(graph.forward_outputs or ())
    for k in ("grads", "input_grads", "buffer_updates"):
        refs += list((getattr(graph, k) or {}).values())
    return {r["ref"] for r in iter_refs(refs)}


def _is_ref(x: Any) -> bool:
    return isinstance(x, dict) and "ref" in x


def _args(op: Op, n: int) -> list[Any]:
    args = list((op.call or {}).get("args", []))
    if len(args) != n or (op.call or {}).get("kwargs"):
        raise GraphError(f"{op.target} takes {len(args)} positional args and kwargs; expected {n} and none", op=op.id)
    return args


def _plain(x: Any, vid: str, op: Op, what: str, views: set[str] | None = None) -> None:
    """`x` is a ref to `vid`, with no view (or only views from `views`)."""
    ok = isinstance(x, dict) and x.get("ref") == vid
    if not ok or any(v[0] not in (views or set()) for v in x.get("view", ())):
        raise GraphError(f"{op.target}: {what} is not {vid} itself: {x!r}", op=op.id)


def _match(graph: Graph, ls: Op) -> _Pattern:
    """The cross-entropy around `ls`, checked op by op against the captured pattern."""
    x_ref, dim, half = _args(ls, 3)
    xm = _meta(graph, x_ref)
    if xm.dim() != 2 or dim not in (1, -1) or half is not False:
        raise GraphError(f"log_softmax over {list(xm.shape)} dim {dim}; chunking needs 2-D rows, dim 1", op=ls.id)
    rows, vocab = xm.shape
    (a,) = ls.outputs
    cast_f = _cast_of(graph, a)
    a_loss = cast_f.outputs[0] if cast_f else a  # what the nll reads: A, or A cast (autocast's float32 loss)
    nll, nllb = (_reader_of(graph, a_loss, f"nll_loss_{k}", ls) for k in ("forward", "backward"))
    (g,) = nllb.outputs
    cast_b = _cast_of(graph, g)
    g_in = cast_b.outputs[0] if cast_b else g  # what the log_softmax backward reads: G, or G cast back
    lsb = _reader_of(graph, g_in, "_log_softmax_backward_data", nllb)
    a_readers = {cast_f.id} if cast_f else {nll.id, nllb.id}
    _only(graph, a, a_readers | {lsb.id}, ls)
    if cast_f:
        _only(graph, a_loss, {nll.id, nllb.id}, cast_f)
    _only(graph, g, {cast_b.id if cast_b else lsb.id}, nllb)
    if cast_b:
        _only(graph, g_in, {lsb.id}, cast_b)
    a_arg, t_ref, weight, reduction, ignore = _args(nll, 5)
    _plain(a_arg, a_loss, nll, "the input")
    tm = _meta(graph, t_ref)
    if weight is not None or reduction != _MEAN or not isinstance(ignore, int) or tuple(tm.shape) != (rows,):
        raise GraphError("nll_loss_forward needs no weight, mean reduction and [rows] targets", op=nll.id)
    if [list(p) for p in nll.call["outs"]] != [[0], [1]]:
        raise GraphError("nll_loss_forward's total weight is unused; expected it read by its backward", op=nll.id)
    _, tw = nll.outputs
    g1_ref, a_arg, t2, weight, reduction, ignore2, tw_arg = _args(nllb, 7)
    _plain(a_arg, a_loss, nllb, "the input")
    _plain(tw_arg, tw, nllb, "the total weight")
    if t2 != t_ref or weight is not None or reduction != _MEAN or ignore2 != ignore:
        raise GraphError("nll_loss_backward differs from its forward (targets, weight, reduction)", op=nllb.id)
    g_arg, a_arg, dim2, dtype = _args(lsb, 4)
    _plain(g_arg, g_in, lsb, "the gradient")
    _plain(a_arg, a, lsb, "the output", _DETACH)
    if dim2 not in (1, -1) or dtype != {"dtype": graph.value[a].dtype}:
        raise GraphError(f"_log_softmax_backward_data over dim {dim2}, {dtype}; expected dim 1, A's dtype", op=lsb.id)
    if not _is_ref(g1_ref) or _meta(graph, g1_ref).dim() != 0:
        raise GraphError("nll_loss_backward's incoming gradient is not a scalar tensor", op=nllb.id)
    return _Pattern(
        ls,
        nll,
        nllb,
        lsb,
        cast_f=cast_f,
        cast_b=cast_b,
        rows=rows,
        x_ref=x_ref,
        t_ref=t_ref,
        g1_ref=g1_ref,
        ignore=ignore,
        dim=dim,
        **_match_grads(graph, lsb, rows, vocab),
    )


def _cast_of(graph: Graph, vid: str) -> Op | None:
    """The op that casts `vid` whole to another dtype (autocast's _to_copy around the loss), if one reads it."""
    for c in graph.consumers[vid]:
        o = graph.op[c]
        args = (o.call or {}).get("args", [])
        if o.target == "aten._to_copy.default" and len(args) == 1 and args[0] == {"ref": vid}:
            if set((o.call or {}).get("kwargs", {})) - _CAST_KWARGS:
                raise GraphError(f"cast of {vid} with {sorted(o.call['kwargs'])}; expected a dtype only", op=o.id)
            return o
    return None


def _reader_of(graph: Graph, vid: str, name: str, after: Op) -> Op:
    found = [graph.op[c] for c in graph.consumers[vid] if graph.op[c].target == f"aten.{name}.default"]
    if len(found) != 1:
        targets = [graph.op[c].target for c in graph.consumers[vid]]
        raise GraphError(f"{after.target} output {vid} read by {targets}; expected one {name}", op=after.id)
    return found[0]


def _match_grads(graph: Graph, lsb: Op, rows: int, vocab: int) -> dict[str, Any]:
    """The loss gradient R (D, or the logits' tangent + D) read by exactly the two mm of the logits' matmul."""
    (d,) = lsb.outputs
    r, found = d, {"add": None, "tangent_ref": None, "tangent_first": True}
    d_readers = [graph.op[c] for c in graph.consumers[d]]
    if len(d_readers) == 1 and d_readers[0].target == "aten.add.Tensor":
        add = found["add"] = d_readers[0]
        found["tangent_ref"], found["tangent_first"] = _match_add(graph, add, d, rows, vocab)
        _only(graph, d, {add.id}, lsb)
        (r,) = add.outputs
    mms = [graph.op[c] for c in graph.consumers[r]]
    producer = found["add"] or lsb
    if len(mms) != 2 or any(o.target != "aten.mm.default" for o in mms):
        raise GraphError(f"loss gradient {r} read by {[o.target for o in mms]}; expected 2 mm", op=producer.id)
    _only(graph, r, {o.id for o in mms}, producer)
    kinds = {_mm_kind(graph, o, r, rows, vocab): o for o in mms}
    if set(kinds) != {"dw", "dh"}:
        raise GraphError("loss gradient's mm are not one weight and one input gradient", op=mms[0].id)
    h_ref, w_ref = kinds["dw"].call["args"][1], kinds["dh"].call["args"][1]
    return {**found, "mm_dw": kinds["dw"], "mm_dh": kinds["dh"], "h_ref": h_ref, "w_ref": w_ref}


def _match_add(graph: Graph, add: Op, d: str, rows: int, vocab: int) -> tuple[Ref, bool]:
    """R = tangent + view(D), both [rows, vocab] in row order: the tangent's ref as [rows, vocab], its side."""
    args = list(add.call.get("args", []))
    if len(args) != 2 or add.call.get("kwargs", {}) not in ({}, {"alpha": 1}) or not all(_is_ref(x) for x in args):
        raise GraphError("the loss gradient's add is not of two tensors (or has an alpha)", op=add.id)
    d_first = isinstance(args[0], dict) and args[0].get("ref") == d
    d_arg, other = (args[0], args[1]) if d_first else (args[1], args[0])
    (out,) = add.outputs
    shape = graph.value[out].shape or ()
    sides = [_meta(graph, x) for x in (d_arg, other)]
    if d_arg["ref"] != d or any(not _is_rows(t, shape) for t in sides) or graph.value[out].stride:
        raise GraphError("the loss gradient's add is not tangent + view(D) of one contiguous shape", op=add.id)
    if sides[0].numel() != rows * vocab or shape[-1] != vocab or d in {r["ref"] for r in iter_refs(other)}:
        raise GraphError("the loss gradient's add is not over the loss's [rows, vocab]", op=add.id)
    as_rows = {"ref": other["ref"], "view": [*other.get("view", []), ["aten.view.default", [[rows, vocab]]]]}
    return as_rows, not d_first


def _mm_kind(graph: Graph, mm: Op, r: str, rows: int, vocab: int) -> str:
    """ "dw": mm(t(R as [rows, vocab]), H as [rows, C]); "dh": mm(R as [rows, vocab], W); else a GraphError."""
    left, right = _args(mm, 2)
    if not _is_ref(left) or not _is_ref(right) or left["ref"] != r or r in {x["ref"] for x in iter_refs(right)}:
        raise GraphError(f"mm reads the loss gradient {r} other than as its left factor", op=mm.id)
    lm, rm = _meta(graph, left), _meta(graph, right)
    if _is_rows(lm, (rows, vocab)) and rm.dim() == 2 and rm.shape[0] == vocab:
        return "dh"
    if _is_rows(lm.t(), (rows, vocab)) and rm.dim() == 2 and rm.shape[0] == rows:
        return "dw"
    raise GraphError(f"mm of the loss gradient as {list(lm.shape)}; expected its rows or their transpose", op=mm.id)


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


def _forward(b: _Builder, p: _Pattern, bounds: list[tuple[int, int]]) -> list[Ref]:
    """TW from the targets alone; per chunk A_c and its summed loss; L = sum / TW. Returns the A_c, TW_c refs."""
    tw = p.nll.outputs[1]
    ne = b.emit("aten.ne.Scalar", [p.t_ref, p.ignore], p.nll, p.nll.phase)
    dtype = {"dtype": b.graph.value[tw].dtype}
    b.emit("aten.sum.dim_IntList", [ne[0], [0], False], p.nll, p.nll.phase, [tw], dtype=dtype)
    kept, sums = [], []
    for s, e in bounds:
        a_c = b.emit("aten._log_softmax.default", [_rows(p.x_ref, s, e), p.dim, False], p.ls, p.ls.phase)[0]
        a_loss = _cast(b, p.cast_f, a_c)
        args = [a_loss, _rows(p.t_ref, s, e), None, _SUM, p.ignore]
        s_c, tw_c = b.emit("aten.nll_loss_forward.default", args, p.nll, p.nll.phase)
        kept.append((a_c, a_loss, tw_c))
        sums.append(s_c if not sums else b.emit("aten.add.Tensor", [sums[-1], s_c], p.nll, p.nll.phase)[0])
    b.emit("aten.div.Tensor", [sums[-1], {"ref": tw}], p.nll, p.nll.phase, [p.nll.outputs[0]])
    return kept


def _backward(b: _Builder, p: _Pattern, bounds: list[tuple[int, int]], kept: list[Any]) -> None:
    """g' = g1 / TW; per chunk G_c, D_c, R_c (+ the logits' tangent rows), dW accumulated, dH_c; dH = cat."""
    (dw,), (dh,) = p.mm_dw.outputs, p.mm_dh.outputs
    g = b.emit("aten.div.Tensor", [p.g1_ref, {"ref": p.nll.outputs[1]}], p.nllb, p.nllb.phase)[0]
    dw_ref, dh_parts = None, []
    for c, (s, e) in enumerate(bounds):
        a_c, a_loss, tw_c = kept[c]
        args = [g, a_loss, _rows(p.t_ref, s, e), None, _SUM, p.ignore, tw_c]
        g_c = _cast(b, p.cast_b, b.emit("aten.nll_loss_backward.default", args, p.nllb, p.nllb.phase)[0])
        dtype = {"dtype": b.graph.value[p.ls.outputs[0]].dtype}
        r_c = b.emit("aten._log_softmax_backward_data.default", [g_c, a_c, p.dim, dtype], p.lsb, p.lsb.phase)[0]
        if p.add is not None:
            pair = [_rows(p.tangent_ref, s, e), r_c] if p.tangent_first else [r_c, _rows(p.tangent_ref, s, e)]
            r_c = b.emit("aten.add.Tensor", pair, p.add, p.add.phase)[0]
        r_t, h_c = {"ref": r_c["ref"], "view": [["aten.t.default", []]]}, _rows(p.h_ref, s, e)
        last = c == len(bounds) - 1
        if dw_ref is None:
            dw_ref = b.emit("aten.mm.default", [r_t, h_c], p.mm_dw, p.mm_dw.phase, [dw] if last else [])[0]
        else:
            dw_ref = b.emit("aten.addmm.default", [dw_ref, r_t, h_c], p.mm_dw, p.mm_dw.phase, [dw] if last else [])[0]
        dh_parts.append(b.emit("aten.mm.default", [r_c, p.w_ref], p.mm_dh, p.mm_dh.phase)[0])
    if len(dh_parts) == 1:  # one chunk: its dH is the whole one; copy into the kept id
        b.emit("aten.clone.default", [dh_parts[0]], p.mm_dh, p.mm_dh.phase, [dh])
    else:
        b.emit("aten.cat.default", [dh_parts, 0], p.mm_dh, p.mm_dh.phase, [dh])


def _rewrite(graph: Graph, p: _Pattern, bounds: list[tuple[int, int]]) -> Graph:
    """The graph with the pattern's ops replaced: the forward block where the log_softmax was, the backward block
    where the first of the two mm was (every reader of dW and dH comes after it)."""
    b = _Builder(graph)
    removed = {o.id for o in (p.ls, p.cast_f, p.nll, p.nllb, p.cast_b, p.lsb, p.add, p.mm_dw, p.mm_dh) if o is not None}
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
            _backward(b, p, bounds, kept)
            ops += b.ops[start:]
        if o.id not in removed:
            ops.append(o)
    gone = {v for o in (p.ls, p.cast_f, p.lsb, p.nllb, p.cast_b, p.add) if o is not None for v in o.outputs}
    values = [v for v in graph.values if v.id not in gone] + list(b.values.values())
    extra = {**graph.extra, "chunk_loss": len(bounds)}
    return replace(graph, values=tuple(values), ops=tuple(ops), extra=extra)
