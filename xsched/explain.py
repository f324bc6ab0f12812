"""Why a plan keeps, recomputes or moves each value: a pass over the plan interpreter (`xsched plan --explain`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from xsched.budgets import format_bytes
from xsched.contracts.graph import Graph, Op
from xsched.contracts.plan import Compute, Copy, Free, Plan, Step
from xsched.contracts.profile import Profile
from xsched.interpret import PlanInterpreter

DECISIONS = ("input", "kept", "recomputed", "moved", "recomputed+moved")


@dataclass(frozen=True)
class ValueExplanation:
    """One value of the plan: what the plan does with it (`decision`), where, and the reason in numbers."""

    value: str
    nbytes: int
    producer: str | None  # op id (None for a graph input)
    target: str  # the producer's target, or the input's kind
    decision: str  # one of DECISIONS
    devices: tuple[str, ...]  # where it is computed (in plan order, recomputes repeated), or its home
    copies: tuple[tuple[int, str, str], ...]  # (step, src, dst)
    reasons: tuple[str, ...] = field(default_factory=tuple)
    held_steps: int = 0  # steps from its first compute to its last read (a kept value; the plan's end for outputs)

    def as_dict(self) -> dict:
        return {
            "value": self.value,
            "nbytes": self.nbytes,
            "producer": self.producer,
            "target": self.target,
            "decision": self.decision,
            "devices": list(self.devices),
            "copies": [list(c) for c in self.copies],
            "reasons": list(self.reasons),
            "held_steps": self.held_steps,
        }


class _Recorder(PlanInterpreter):
    """The interpreter's walk, keeping each value's computes, copies, frees and reads, and the bytes per device
    during every step."""

    def begin(self) -> None:
        self.computes: dict[str, list[tuple[int, str]]] = {}  # op -> (step, device)
        self.copied: dict[str, list[tuple[int, str, str]]] = {}
        self.freed: dict[str, list[tuple[int, str]]] = {}
        self.reads: dict[str, list[tuple[int, str, str]]] = {}  # value -> (step, op, device)
        self.during: list[dict[str, int]] = []
        self._now: dict[str, int] = {}

    def bump(self, i: int, device: str, during: int, **where: str) -> None:
        super().bump(i, device, during, **where)
        self._now[device] = max(self._now.get(device, 0), during)

    def on_compute(self, i: int, s: Compute, op: Op) -> None:
        self.computes.setdefault(op.id, []).append((i, s.device))
        for v in op.inputs:
            self.reads.setdefault(v, []).append((i, op.id, s.device))

    def on_copy(self, i: int, s: Copy) -> None:
        self.copied.setdefault(s.value, []).append((i, s.src, s.dst))

    def on_free(self, i: int, s: Free) -> None:
        self.freed.setdefault(s.value, []).append((i, s.device))

    def after_step(self, i: int, s: Step) -> None:
        self.during.append({d: max(self.used[d], self._now.get(d, 0)) for d in self.devices})
        self._now = {}


def explain(graph: Graph, plan: Plan, profile: Profile | None = None) -> tuple[ValueExplanation, ...]:
    """One explanation per value the plan computes or moves (graph inputs only when moved), in graph order."""
    rec = _Recorder(graph, plan)
    rec.run()
    out = []
    for v in graph.values:
        op = graph.op.get(graph.producer[v.id]) if v.id in graph.producer else None
        copies = tuple(rec.copied.get(v.id, ()))
        if op is None:
            if copies:
                out.append(
                    ValueExplanation(
                        v.id,
                        v.nbytes,
                        None,
                        v.kind,
                        "moved",
                        (plan.homes[v.id],),
                        copies,
                        tuple(_copy_reasons(graph, plan, profile, rec, v.id)),
                    )
                )
            continue
        runs = rec.computes.get(op.id, [])
        recomputed = len(runs) > 1
        decision = (
            "recomputed+moved"
            if recomputed and copies
            else "recomputed"
            if recomputed
            else ("moved" if copies else "kept")
        )
        reasons, held = [], 0
        if recomputed:
            reasons += _recompute_reasons(plan, profile, rec, v.id, op.id, v.nbytes)
        if copies:
            reasons += _copy_reasons(graph, plan, profile, rec, v.id)
        if not recomputed:
            why, held = _keep_reason(graph, plan, profile, rec, v.id, op.id, runs[0])
            reasons.append(why)
        out.append(
            ValueExplanation(
                v.id, v.nbytes, op.id, op.target, decision, tuple(d for _, d in runs), copies, tuple(reasons), held
            )
        )
    return tuple(out)


def _ms(profile: Profile | None, op: str, device: str) -> float | None:
    cost = profile.op_cost(op, device) if profile is not None else None
    return None if cost is None else cost.time_s * 1e3


def _budget_text(plan: Plan, device: str, need: int) -> str:
    budget = plan.budgets.get(device)
    if budget is None:
        return f"{format_bytes(need)} on {device} (no budget)"
    verdict = "over" if need > budget else "within"
    return f"{format_bytes(need)} on {device}, {verdict} its budget of {format_bytes(budget)}"


def _recompute_reasons(plan: Plan, profile: Profile | None, rec: _Recorder, v: str, op: str, nbytes: int) -> list[str]:
    """For each recompute: the free before it, and what keeping the value instead would have needed."""
    reasons = []
    runs = rec.computes[op]
    for (i0, d0), (i1, d1) in zip(runs, runs[1:]):
        frees = [j for j, d in rec.freed.get(v, []) if d == d1 and i0 <= j < i1]
        ms = _ms(profile, op, d1)
        cost = f"{ms:.3g} ms" if ms is not None else "an unprofiled compute"
        if d1 != d0 and not frees:
            reasons.append(f"recomputed on {d1} at step {i1} rather than copied from {d0} ({cost})")
            continue
        start = frees[-1] if frees else i0
        held = max((rec.during[k].get(d1, 0) for k in range(start, i1)), default=0) + nbytes
        why = f"freed on {d1} at step {start}, recomputed at step {i1} ({cost}): keeping it would need "
        why += _budget_text(plan, d1, held)
        siblings = [w for w in rec.graph.op[op].outputs if w != v]
        if siblings and held <= plan.budgets.get(d1, held):
            why += f"; its op also makes {', '.join(siblings)}, recomputed with it"
        reasons.append(why)
    return reasons


def _copy_reasons(graph: Graph, plan: Plan, profile: Profile | None, rec: _Recorder, v: str) -> list[str]:
    reasons = []
    for i, src, dst in rec.copied.get(v, []):
        reader = next(((k, o, d) for k, o, d in rec.reads.get(v, []) if k > i and d == dst), None)
        back = any(k > i and s2 == dst and d2 == src for k, s2, d2 in rec.copied.get(v, []))
        if reader is not None:
            k, o, _ = reader
            here, there = _ms(profile, o, dst), _ms(profile, o, src)
            if there is None and profile is not None:
                why = f"{o} cannot run on {src}"
            elif here is not None and there is not None:
                why = f"{o} runs on {dst}: {here:.3g} ms there, {there:.3g} ms on {src}"
            else:
                why = f"{o} runs on {dst}"
            reasons.append(f"copied {src}->{dst} at step {i} for {o} at step {k}; {why}")
        elif back:
            reasons.append(
                f"parked on {dst} at step {i} and copied back later, to free {format_bytes(graph.value[v].nbytes)} on {src}"
            )
        else:
            reasons.append(f"copied {src}->{dst} at step {i}: an output that must end on {dst}")
    return reasons


def _keep_reason(
    graph: Graph, plan: Plan, profile: Profile | None, rec: _Recorder, v: str, op: str, run: tuple[int, str]
) -> tuple[str, int]:
    """Why a value computed once stays: how long it is held, and what recomputing it would cost instead."""
    i, d = run
    ms = _ms(profile, op, d)
    cost = f"; recomputing it would cost {ms:.3g} ms" if ms is not None else ""
    if v in graph.outputs:
        return f"a graph output, computed on {d} at step {i} and kept to the end", len(plan.steps) - i
    last = max((k for k, _, dev in rec.reads.get(v, []) if dev == d), default=None)
    if last is None:
        return f"computed on {d} at step {i}, read by no op there{cost}", 0
    return f"kept on {d} from step {i} to its last read at step {last}{cost}", last - i


def summary(rows: tuple[ValueExplanation, ...]) -> Mapping[str, int]:
    """How many values got each decision."""
    return {k: sum(r.decision == k for r in rows) for k in DECISIONS if any(r.decision == k for r in rows)}


def explain_table(rows: tuple[ValueExplanation, ...], kept_rows: int = 10) -> str:
    """A text table: every recomputed or moved value, and the `kept_rows` kept ones holding the most bytes for the
    most steps (the first candidates for recomputation)."""
    shown = [r for r in rows if r.decision != "kept"]
    kept = sorted((r for r in rows if r.decision == "kept"), key=lambda r: -r.nbytes * r.held_steps)
    shown += kept[:kept_rows]
    head = ("value", "size", "producer", "decision", "devices", "why")
    body = [
        (
            r.value,
            format_bytes(r.nbytes),
            r.target.removeprefix("aten."),
            r.decision,
            ",".join(dict.fromkeys(r.devices)),
            "; ".join(r.reasons),
        )
        for r in shown
    ]
    widths = [max(len(x[c]) for x in [head, *body]) for c in range(5)]
    lines = ["  ".join(f"{x[c]:<{widths[c]}}" for c in range(5)) + "  " + x[5] for x in [head, *body]]
    counts = ", ".join(f"{n} {k}" for k, n in summary(rows).items())
    more = f"; {len(kept) - kept_rows} more kept values not shown (--json lists all)" if len(kept) > kept_rows else ""
    return "\n".join([f"values: {counts}{more}", *lines])


# ---- reserved memory: what a caching allocator takes from the device for the plan's peak ----
_SMALL = 1 << 20  # PyTorch's CUDA caching allocator: blocks up to 1 MiB come from 2 MiB segments
_SMALL_SEGMENT = 2 << 20
_LARGE_SEGMENT = 20 << 20  # blocks of 1-10 MiB from 20 MiB segments
_LARGE_ALONE = 10 << 20  # larger blocks get a segment of their own, rounded up to 2 MiB


@dataclass(eq=False)  # blocks are found by identity
class _Block:
    segment: int
    offset: int
    size: int
    free: bool


@dataclass(frozen=True)
class Reserved:
    """One device's modelled caching-allocator peak: the plan's peak (`allocated`, bytes of values), the memory the
    allocator reserves for it (`reserved`), both above the inputs homed there, and the share lost to rounding and
    fragmentation (`reserved / allocated - 1`)."""

    allocated: int
    reserved: int
    base: int = 0  # reserved for the homed inputs before the step (the step may fill their segments' free room)

    @property
    def fragmentation(self) -> float:
        return self.reserved / self.allocated - 1 if self.allocated else 0.0


class AllocatorModel:
    """PyTorch's CUDA caching allocator in outline: sizes rounded up to 512 B; a best fit among the free blocks of
    the size's pool (small: up to 1 MiB), split when what is left is worth keeping (512 B small, over 1 MiB large);
    a new segment when none fits (2 MiB small, 20 MiB for 1-10 MiB, the block itself rounded up to 2 MiB above);
    freed blocks merge with free neighbours in their segment; segments are never given back within a step."""

    def __init__(self) -> None:
        self.segments: list[list[_Block]] = []
        self.small: list[bool] = []  # each segment's pool
        self.live: dict[object, _Block] = {}
        self.reserved = self.peak_reserved = 0

    def alloc(self, key: object, nbytes: int) -> None:
        if nbytes <= 0:
            return
        size = max(512, -(-nbytes // 512) * 512)
        small = size <= _SMALL
        fits = [
            b for k, seg in enumerate(self.segments) if self.small[k] == small for b in seg if b.free and b.size >= size
        ]
        block = min(fits, key=lambda b: (b.size, b.segment, b.offset), default=None)
        if block is None:
            whole = (
                _SMALL_SEGMENT
                if small
                else _LARGE_SEGMENT
                if size < _LARGE_ALONE
                else -(-size // (2 << 20)) * (2 << 20)
            )
            block = _Block(len(self.segments), 0, whole, True)
            self.segments.append([block])
            self.small.append(small)
            self.reserved += whole
            self.peak_reserved = max(self.peak_reserved, self.reserved)
        rest = block.size - size
        if rest >= 512 if small else rest > _SMALL:
            seg = self.segments[block.segment]
            seg.insert(seg.index(block) + 1, _Block(block.segment, block.offset + size, rest, True))
            block.size = size
        block.free = False
        self.live[key] = block

    def free(self, key: object) -> None:
        block = self.live.pop(key, None)
        if block is None:
            return
        block.free = True
        seg = self.segments[block.segment]
        k = seg.index(block)
        if k + 1 < len(seg) and seg[k + 1].free:
            block.size += seg.pop(k + 1).size
        if k > 0 and seg[k - 1].free:
            seg[k - 1].size += seg.pop(k).size


class _Allocations(PlanInterpreter):
    """The plan's allocations and frees per device, in plan order, replayed on one AllocatorModel each."""

    def __init__(self, graph: Graph, plan: Plan, profile: Profile | None) -> None:
        super().__init__(graph, plan)
        self.profile = profile
        self.models = {d: AllocatorModel() for d in self.devices}
        for v in graph.inputs:  # the homed inputs are allocated before the step
            self.models[plan.homes[v]].alloc(v, self.nbytes[v])
        self.base = {d: m.reserved for d, m in self.models.items()}
        for m in self.models.values():
            m.peak_reserved = m.reserved

    def workspace(self, i: int, s: Compute, op: Op) -> int:
        cost = self.profile.op_cost(op.id, s.device) if self.profile is not None else None
        return max(op.workspace_bytes, cost.workspace_bytes if cost else 0)

    def on_compute(self, i: int, s: Compute, op: Op) -> None:
        m = self.models[s.device]
        for v in op.outputs:
            if v not in self.resident[s.device]:
                m.alloc(v, self.nbytes[v])
        m.alloc(("workspace", i), self.workspace(i, s, op))
        m.free(("workspace", i))

    def on_copy(self, i: int, s: Copy) -> None:
        self.models[s.dst].alloc(s.value, self.nbytes[s.value])

    def on_free(self, i: int, s: Free) -> None:
        self.models[s.device].free(s.value)

    def end(self) -> dict[str, Reserved]:
        homed = {d: sum(self.nbytes[v] for v, h in self.plan.homes.items() if h == d) for d in self.devices}
        return {
            d: Reserved(self.peak[d] - homed[d], m.peak_reserved - self.base[d], self.base[d])
            for d, m in self.models.items()
        }


def reserved_peaks(graph: Graph, plan: Plan, profile: Profile | None = None) -> dict[str, Reserved]:
    """Per device: the plan's peak and what a CUDA caching allocator would reserve for it (above the homed inputs
    and the segments they hold), replaying the plan's allocations and frees on AllocatorModel."""
    return _Allocations(graph, plan, profile).run()


def _host(device: str, profile: Profile | None) -> bool:
    """Host memory has no caching allocator of this kind in a plan's run."""
    info = profile.devices.get(device) if profile is not None else None
    return device.startswith("cpu") or (info is not None and info.kind == "cpu")


def reserved_text(graph: Graph, plan: Plan, profile: Profile | None = None) -> str:
    """`--explain`'s line on fragmentation: per device, the reserved memory expected for the plan's peak."""
    parts = [
        f"{d}: {format_bytes(r.reserved)} reserved for a peak of {format_bytes(r.allocated)} ({r.fragmentation:+.1%})"
        for d, r in reserved_peaks(graph, plan, profile).items()
        if r.allocated and not _host(d, profile)
    ]
    if not parts:
        return ""
    return (
        "caching allocator (PyTorch CUDA's, modelled; above the homed inputs): "
        + "; ".join(parts)
        + ". On a GPU the step's max_memory_reserved is expected there, not at the peak."
    )
