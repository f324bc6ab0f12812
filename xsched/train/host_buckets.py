"""The host optimizer's buckets: the trained parameters packed into flat buffers (the weights the run reads, and,
where they differ, fp32 master weights the update steps), fp32 gradients and one fused AdamW per segment; and their
state as torch.optim.AdamW's state dict over the parameters, plus the master weights where they are kept apart."""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from xsched.errors import XschedError
from xsched.execute.host_pin import PinnedSlabs, pinned_empty


@dataclass
class Segment:
    """Parameters of one bucket that share a weight decay and dtype. `compute`: the flat buffer the parameters are
    views of (what the run reads); `flat`: the master weights AdamW steps (fp32; the same tensor as `compute` unless
    the weights are low precision or the update is delayed); `grad`: the fp32 gradients."""

    params: list[nn.Parameter]
    compute: torch.Tensor
    flat: torch.Tensor
    grad: torch.Tensor
    opt: torch.optim.AdamW
    spans: list[tuple[int, int]]  # (offset, numel) of each param in the flat buffers

    @property
    def separate(self) -> bool:
        return self.flat is not self.compute

    def write_back(self) -> None:
        """The master weights into the weights the run reads (rounded to their dtype)."""
        if self.separate:
            self.compute.copy_(self.flat)


@dataclass
class Bucket:
    index: int
    segments: list[Segment]
    slots: dict[str, tuple[Segment, int, int]]  # param name -> its segment, offset, numel
    arrived: dict[str, tuple[torch.Tensor, Sequence[Any]]] = field(default_factory=dict)
    done_this_backward: bool = False
    idle: threading.Event = field(default_factory=threading.Event)  # set: no update of it under way
    grads_in: threading.Event = field(default_factory=threading.Event)  # set: this step's gradients are in
    readable: threading.Event = field(default_factory=threading.Event)  # set: no write-back of it under way or due
    pending: bool = False  # the master weights hold an update the run's weights do not have yet (delayed update)
    write_after_step: bool = False  # the write-back is due as soon as the update under way ends
    norm_sq: float = 0.0

    def write_back(self) -> None:
        for seg in self.segments:
            seg.write_back()
        self.pending = False


def chunks(named: Sequence[tuple[str, nn.Parameter]], limit: int) -> list[list[tuple[str, nn.Parameter]]]:
    """Consecutive runs of `named` of at least `limit` bytes each (the last may be smaller)."""
    out: list[list[tuple[str, nn.Parameter]]] = []
    size = limit
    for n, p in named:
        if size >= limit:
            out.append([])
            size = 0
        out[-1].append((n, p))
        size += p.numel() * p.element_size()
    return out


Group = tuple[float, torch.dtype, torch.device]  # a segment's weight decay, dtype and device


def segment_groups(
    chunk: Sequence[tuple[str, nn.Parameter]], decay: Mapping[str, float]
) -> dict[Group, list[tuple[str, nn.Parameter]]]:
    """A bucket's parameters grouped into its segments, in order: those of one weight decay, dtype and device."""
    keys: dict[Group, list[tuple[str, nn.Parameter]]] = {}
    for n, p in chunk:
        keys.setdefault((decay[n], p.dtype, p.device), []).append((n, p))
    return keys


@dataclass
class PinnedHome:
    """Where a host optimizer's pinned buffers come from (beside a GPU): slabs per dtype for the weights and,
    apart (a checkpoint of the weights writes no gradient), for the fp32 gradients the run copies home."""

    weights: dict[torch.dtype, PinnedSlabs]
    grads: PinnedSlabs

    @classmethod
    def sized(cls, buckets: Iterable[Sequence[tuple[str, nn.Parameter]]], decay: Mapping[str, float]) -> PinnedHome:
        """Slabs placed for the host segments of these buckets (each a chunk of `make_bucket`): the weights that
        `packed` copies into them (`slab_room`), and the fp32 gradients."""
        weights: dict[torch.dtype, list[int]] = {}
        grads: list[int] = []
        for chunk in buckets:
            for (_, dtype, device), members in segment_groups(chunk, decay).items():
                if device.type != "cpu":
                    continue
                numel = sum(p.numel() for _, p in members)
                room = slab_room([p for _, p in members])
                weights.setdefault(dtype, []).extend([room] if room else [])
                grads.extend([numel] if dtype == torch.float32 else [])
        return cls({d: PinnedSlabs(d, sizes) for d, sizes in weights.items()}, PinnedSlabs(torch.float32, grads))


def make_bucket(
    index: int,
    chunk: Sequence[tuple[str, nn.Parameter]],
    decay: Mapping[str, float],
    lr: float,
    separate: bool,
    pinned: PinnedHome | None = None,
) -> Bucket:
    """Pack the chunk's parameters into one flat buffer per (weight decay, dtype, device): each parameter becomes a
    view (a parameter homed on the computing device, Twin-Flow's split, is updated there).
    Master weights of their own (fp32) where `separate` or the parameters are not fp32. `pinned`: the host
    buffers the run reads come from there (beside a GPU: `XschedModule.pins_host`), each weight's bytes pinned
    once (see `packed`)."""
    segments, slots = [], {}
    for (wd, dtype, device), members in segment_groups(chunk, decay).items():
        home = pinned if pinned is not None and device.type == "cpu" else None
        compute, spans = packed([p for _, p in members], home.weights[dtype] if home is not None else None)
        own = separate or dtype != torch.float32
        flat = compute.to(torch.float32, copy=True) if own else compute
        # pinned beside a GPU: gradients are copied home straight into it (ParamPoints' grad_into); bf16
        # gradients are cast into it by the worker instead: nothing lands there, so it is not pinned
        if compute.is_pinned() and dtype == flat.dtype:
            grad = (home.grads.empty(flat.numel()) if home is not None else pinned_empty(flat.shape, dtype)).zero_()
        else:
            grad = torch.zeros(flat.shape, dtype=flat.dtype, device=flat.device)
        seg = Segment([p for _, p in members], compute, flat, grad, _adamw(flat, lr, wd), spans)
        flat.grad = grad
        segments.append(seg)
        slots.update({n: (seg, o, k) for (n, _), (o, k) in zip(members, spans)})
    b = Bucket(index, segments, slots)
    for ev in (b.idle, b.grads_in, b.readable):
        ev.set()
    return b


def packed(
    params: Sequence[nn.Parameter], slabs: PinnedSlabs | None = None
) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """One flat buffer that `params` (of one dtype and device) become views of, in order, and each one's (offset,
    numel) in it. A lone contiguous parameter keeps its own memory: a large one (most of a large model's bytes)
    is not copied, unless `slabs` (pinned memory) is given and it is not pinned yet: then it is copied once, into
    them. Several are copied into a new buffer from `slabs`, or pinned alone where they are pinned (the run's
    copies to a GPU read it asynchronously). With `slabs` and nothing pinned before, each weight's bytes are pinned
    once, here, in their final home."""
    first = params[0]
    if len(params) == 1 and first.is_contiguous():
        if slabs is not None and slab_room(params):
            with torch.no_grad():
                first.data = slabs.pin(first.data)
        return first.data.view(-1), [(0, first.numel())]
    total = sum(p.numel() for p in params)
    if slabs is not None:
        compute = slabs.empty(total)
    elif first.is_pinned():
        compute = pinned_empty((total,), first.dtype)
    else:
        compute = torch.empty(total, dtype=first.dtype, device=first.device)
    spans, off = [], 0
    with torch.no_grad():
        for p in params:
            compute[off : off + p.numel()].copy_(p.detach().reshape(-1))
            p.data = compute[off : off + p.numel()].view(p.shape)
            spans.append((off, p.numel()))
            off += p.numel()
    return compute, spans


def slab_room(params: Sequence[nn.Parameter]) -> int:
    """The elements `packed` takes from pinned slabs for `params`: none for a lone contiguous parameter pinned
    already (it keeps its memory), else all of theirs."""
    first = params[0]
    return 0 if len(params) == 1 and first.is_contiguous() and first.is_pinned() else sum(p.numel() for p in params)


NORM_ROW = 1 << 16  # a row of the norm's 2-D view: enough rows for every thread even in a small bucket


def sq_norm(t: torch.Tensor) -> float:
    """The squared 2-norm of a flat tensor, reduced over rows of a 2-D view: torch reduces a 1-D tensor's norm on
    one thread (its last-dimension kernel splits the work by output), a 2-D view's on all of them."""
    rows = t.numel() // NORM_ROW
    if rows < 2:
        return float(torch.linalg.vector_norm(t)) ** 2
    body = torch.linalg.vector_norm(t[: rows * NORM_ROW].view(rows, NORM_ROW), dim=1)
    return float(torch.linalg.vector_norm(body)) ** 2 + float(torch.linalg.vector_norm(t[rows * NORM_ROW :])) ** 2


def adamw_step(segments: Sequence[Segment], lr: float) -> None:
    """One AdamW step of the segments at rate `lr`: torch's fused kernel called directly, once per weight decay
    over the segments' buffers, exactly as torch.optim.AdamW(fused=True).step() calls it (its state stays in each
    segment's optimizer), without that method's per-call Python; the optimizer's own step where it is not fused."""
    groups: dict[tuple, list[Segment]] = {}
    for seg in segments:
        g = seg.opt.param_groups[0]
        if not g.get("fused") or g["amsgrad"] or g["maximize"] or g.get("capturable") or g.get("differentiable"):
            g["lr"] = lr
            seg.opt.step()
            continue
        groups.setdefault((g["betas"], g["eps"], g["weight_decay"]), []).append(seg)
    for (betas, eps, wd), members in groups.items():
        states = [_state(seg) for seg in members]
        steps = [st["step"] for st in states]
        torch._foreach_add_(steps, 1)
        torch._fused_adamw_(
            [seg.flat for seg in members],
            [seg.grad for seg in members],
            [st["exp_avg"] for st in states],
            [st["exp_avg_sq"] for st in states],
            [],
            steps,
            amsgrad=False,
            lr=lr,
            beta1=betas[0],
            beta2=betas[1],
            weight_decay=wd,
            eps=eps,
            maximize=False,
            grad_scale=None,
            found_inf=None,
        )
        for seg in members:
            seg.opt.param_groups[0]["lr"] = lr


def _state(seg: Segment) -> dict[str, torch.Tensor]:
    """The segment's AdamW state, made as torch's fused AdamW makes it on its first step."""
    st = seg.opt.state[seg.flat]
    if not st:
        st["step"] = torch.zeros((), dtype=torch.float32, device=seg.flat.device)
        st["exp_avg"] = torch.zeros_like(seg.flat, memory_format=torch.preserve_format)
        st["exp_avg_sq"] = torch.zeros_like(seg.flat, memory_format=torch.preserve_format)
    return st


def _adamw(flat: torch.Tensor, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """torch's fused AdamW over one flat buffer (one kernel per step), foreach where fused is not built."""
    try:
        return torch.optim.AdamW([flat], lr=lr, weight_decay=weight_decay, fused=True)
    except RuntimeError:
        return torch.optim.AdamW([flat], lr=lr, weight_decay=weight_decay, foreach=True)


def export_state(segments: Iterable[Segment], facade: torch.optim.Optimizer) -> None:
    """Point `facade` (an AdamW over the same parameters, never stepped) at the segments' state: views into the
    flat buffers, saved by torch.save as one storage per buffer."""
    for seg in segments:
        st = seg.opt.state.get(seg.flat)
        if not st:
            continue
        for p, (off, n) in zip(seg.params, seg.spans):
            facade.state[p] = {
                "step": st["step"].clone(),  # its own: torch's for-loop AdamW steps a loaded "step" in place
                "exp_avg": st["exp_avg"][off : off + n].view(p.shape),
                "exp_avg_sq": st["exp_avg_sq"][off : off + n].view(p.shape),
            }


def import_state(segments: Iterable[Segment], facade: torch.optim.Optimizer, names: Mapping[nn.Parameter, str]) -> None:
    """Take the state `facade` loaded (a torch AdamW state dict) into the flat buffers, and empty it."""
    group_of = {p: g for g in facade.param_groups for p in g["params"]}
    for seg in segments:
        states = [facade.state.get(p) for p in seg.params]
        seg.opt.state.clear()
        if all(not s for s in states):
            continue
        steps = {float(s["step"]) if s else None for s in states}
        if len(steps) != 1:
            raise XschedError(
                f"the optimizer state gives the parameters {', '.join(names[p] for p in seg.params)} different "
                f"step counts {sorted(steps, key=str)}; the host optimizer steps them together",
                stage="train",
            )
        exp_avg, exp_avg_sq = torch.empty_like(seg.flat), torch.empty_like(seg.flat)
        for s, (off, n) in zip(states, seg.spans):
            exp_avg[off : off + n].copy_(s["exp_avg"].reshape(-1))
            exp_avg_sq[off : off + n].copy_(s["exp_avg_sq"].reshape(-1))
        step = torch.tensor(steps.pop(), dtype=torch.float32, device=seg.flat.device)
        seg.opt.state[seg.flat] = {"step": step, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
        group = group_of[seg.params[0]]
        for key in ("betas", "eps", "weight_decay"):
            seg.opt.param_groups[0][key] = group[key]
    facade.state.clear()


def master_state(segments: Iterable[Segment], names: Mapping[nn.Parameter, str]) -> dict[str, torch.Tensor]:
    """The fp32 master weights kept apart from the parameters, by parameter name (views into the buffers)."""
    return {
        names[p]: seg.flat[off : off + n].view(p.shape)
        for seg in segments
        if seg.separate
        for p, (off, n) in zip(seg.params, seg.spans)
    }


def masters_from_weights(segments: Iterable[Segment], params: Iterable[nn.Parameter]) -> None:
    """The master weights kept apart of `params` set to the weights the run reads (which were loaded)."""
    wanted = {id(p) for p in params}
    for seg in segments:
        for p, (off, n) in zip(seg.params, seg.spans):
            if seg.separate and id(p) in wanted:
                seg.flat[off : off + n].copy_(seg.compute[off : off + n])


def load_master(segments: Iterable[Segment], names: Mapping[nn.Parameter, str], saved: Mapping[str, Any]) -> None:
    """Master weights from a checkpoint; a parameter it has none for starts from its own weights (fp32)."""
    for seg in segments:
        if not seg.separate:
            continue
        for p, (off, n) in zip(seg.params, seg.spans):
            src = saved.get(names[p])
            seg.flat[off : off + n].copy_((src if src is not None else p.detach()).reshape(-1))
