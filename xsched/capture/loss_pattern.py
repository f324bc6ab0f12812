"""The captured cross-entropy pattern (log_softmax + nll_loss, their backward, the logits' matmul) that
xsched.capture.chunk_loss splits into row blocks, found and checked op by op."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from xsched.contracts.graph import Graph, Op
from xsched.contracts.torch_ops import apply_view, iter_refs, laid_out
from xsched.errors import GraphError

Ref = dict[str, Any]
_DETACH = {"aten.detach.default", "aten.alias.default"}
_CAST_KWARGS = {"dtype", "layout", "device"}
MEAN = 1  # torch's Reduction enum as nll_loss takes it


@dataclass(frozen=True)
class LossPattern:
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
    x_mm: Op | None  # X = mm(H rows, W^T) when only the log_softmax reads X (a model returning its loss alone)
    t_ref: Ref  # the targets as [N]
    g1_ref: Ref  # the loss's incoming gradient
    ignore: int
    dim: int
    tangent_ref: Ref | None  # the logits' tangent as [N, V] (with add)
    tangent_first: bool  # the add's argument order, kept
    h_ref: Ref  # dW's right factor as [N, C]
    w_ref: Ref  # dH's right factor


def find_cross_entropy(graph: Graph) -> LossPattern | None:
    """The graph's cross-entropy, checked against the captured pattern (a one-line GraphError naming the op where
    it differs); None when no _log_softmax is read by nll_loss_forward, directly or cast to float32 (autocast)."""
    found = [o for o in graph.ops if o.target == "aten._log_softmax.default" and _feeds_nll(graph, o.outputs[0])]
    if not found:
        return None
    if len(found) > 1:
        raise GraphError(f"{len(found)} cross-entropies; chunking handles one", op=found[1].id)
    return _match(graph, found[0])


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


def _match(graph: Graph, ls: Op) -> LossPattern:
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
    if weight is not None or reduction != MEAN or not isinstance(ignore, int) or tuple(tm.shape) != (rows,):
        raise GraphError("nll_loss_forward needs no weight, mean reduction and [rows] targets", op=nll.id)
    if [list(p) for p in nll.call["outs"]] != [[0], [1]]:
        raise GraphError("nll_loss_forward's total weight is unused; expected it read by its backward", op=nll.id)
    _, tw = nll.outputs
    g1_ref, a_arg, t2, weight, reduction, ignore2, tw_arg = _args(nllb, 7)
    _plain(a_arg, a_loss, nllb, "the input")
    _plain(tw_arg, tw, nllb, "the total weight")
    if t2 != t_ref or weight is not None or reduction != MEAN or ignore2 != ignore:
        raise GraphError("nll_loss_backward differs from its forward (targets, weight, reduction)", op=nllb.id)
    g_arg, a_arg, dim2, dtype = _args(lsb, 4)
    _plain(g_arg, g_in, lsb, "the gradient")
    _plain(a_arg, a, lsb, "the output", _DETACH)
    if dim2 not in (1, -1) or dtype != {"dtype": graph.value[a].dtype}:
        raise GraphError(f"_log_softmax_backward_data over dim {dim2}, {dtype}; expected dim 1, A's dtype", op=lsb.id)
    if not _is_ref(g1_ref) or _meta(graph, g1_ref).dim() != 0:
        raise GraphError("nll_loss_backward's incoming gradient is not a scalar tensor", op=nllb.id)
    return LossPattern(
        ls,
        nll,
        nllb,
        lsb,
        cast_f=cast_f,
        cast_b=cast_b,
        rows=rows,
        x_ref=x_ref,
        x_mm=_logits_matmul(graph, ls, x_ref, rows, vocab),
        t_ref=t_ref,
        g1_ref=g1_ref,
        ignore=ignore,
        dim=dim,
        **_match_grads(graph, lsb, rows, vocab),
    )


def _logits_matmul(graph: Graph, ls: Op, x_ref: Ref, rows: int, vocab: int) -> Op | None:
    """The mm that makes the logits X [rows, vocab] where nothing but the log_softmax reads them (no forward
    output, no held output): chunked too, so that no [rows, vocab] tensor is made whole. None where X stays."""
    x = x_ref["ref"]
    mm = graph.op.get(graph.producer.get(x, ""))
    if mm is None or mm.target != "aten.mm.default" or graph.consumers[x] != (ls.id,):
        return None
    if x in graph.outputs or x in graph.held_outputs or x in _role_refs(graph) or graph.value[x].stride:
        return None
    args = (mm.call or {}).get("args", [])
    if len(args) != 2 or (mm.call or {}).get("kwargs") or not all(_is_ref(a) for a in args):
        return None
    whole = graph.value[x].shape == (rows, vocab) and _is_rows(_meta(graph, x_ref), (rows, vocab))
    return mm if whole and _meta(graph, args[0]).shape[0] == rows else None


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
