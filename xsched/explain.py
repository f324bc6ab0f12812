"""Why a plan keeps, recomputes or moves each value: a pass over the plan interpreter (`xsched plan --explain`)."""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

from xsched.allocator import ReservedPeak, reserved_range
from xsched.allocator.placement import ArenaPlan
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


# ---- reserved memory: what the caching allocator takes from each GPU for the plan (xsched.allocator) ----
Range = tuple[ReservedPeak, ReservedPeak]  # (the GPU keeping up with the host, the host a step ahead)


@dataclass(frozen=True)
class ExpectedReserved:
    """One accelerator's reserved memory as the allocator model expects it for the plan, each a Range: PyTorch's
    default settings, expandable segments (the executor's `expandable_segments`), and planned addresses in whole-step
    runs (`xsched run --planned-addresses`: the executor's `planned_addresses="whole"`, the default settings for what
    runs outside the arena). `arena_bytes`: that arena, placed as the executor places it (greedy, then the seeded
    search of xsched.allocator.arena_search)."""

    default: Range
    expandable: Range
    planned: Range
    arena_bytes: int

    @property
    def outside(self) -> int:
        """With planned addresses, the most bytes allocated outside the arena and the homed inputs at once (the
        host a step ahead): values the arena does not hold and workspaces, in the allocator's rounded blocks."""
        high = self.planned[1]
        return high.allocated - high.base_allocated - self.arena_bytes

    def as_dict(self) -> dict:
        return {
            "default": [r.as_dict() for r in self.default],
            "expandable": [r.as_dict() for r in self.expandable],
            "planned_addresses": [r.as_dict() for r in self.planned],
            "arena_bytes": self.arena_bytes,
            "outside_arena": self.outside,
        }


def expected_reserved(
    graph: Graph, plan: Plan, profile: Profile | None = None, devices: Collection[str] | None = None
) -> dict[str, ExpectedReserved]:
    """Per modelled device with a peak (`devices`, default every plan device but the host): its ExpectedReserved.
    The arena comes from the executor's own selection (ArenaPlan) and offsets, as the run places them."""
    default = reserved_range(graph, plan, profile, devices=devices)
    if not any(low.plan_peak for low, _ in default.values()):  # no accelerator: no arena to size
        return {}
    arena = ArenaPlan(
        graph, plan, handed=False, profile=profile
    ).addresses  # whole steps, as `xsched run --planned-addresses`
    grown = reserved_range(graph, plan, profile, devices=devices, expandable=True)
    # in-place reuse is off with planned addresses (reserved_range's default: none)
    planned = reserved_range(graph, plan, profile, devices=devices, arena=arena)
    return {
        d: ExpectedReserved(default[d], grown[d], planned[d], arena.arena_bytes.get(d, 0))
        for d in default
        if default[d][0].plan_peak
    }


def reserved_text(graph: Graph, plan: Plan, profile: Profile | None = None) -> str:
    """`--explain`'s line on fragmentation: per accelerator, the reserved memory the allocator model expects, with the
    allocator's default settings, with expandable segments (the executor's `expandable_segments` option) and with
    planned addresses (its `planned_addresses`)."""
    expected = expected_reserved(graph, plan, profile)
    if not expected:
        return ""
    parts = [_device_text(d, e) for d, e in expected.items()]
    replanned = [m for m in plan.solver.message.split("; ") if m.startswith("re-planned for reserved memory")]
    return (
        "".join(f"{m}. " for m in replanned)
        + "caching allocator (PyTorch CUDA's rules, modelled, not measured): "
        + "; ".join(parts)
        + (
            ". A range runs from the GPU keeping up with the host to the host a step ahead (the blocks a copy's "
            "stream still reads held back)"
            if any(e.default[0].reserved != e.default[1].reserved for e in expected.values())
            else ""
        )
        + ". Expandable segments: the executor's expandable_segments option (PyTorch's expandable_segments:True, one "
        "growing segment per pool and stream). Planned addresses: the step's values at planned offsets in one "
        "arena per device, at the offsets the run places them at (`xsched run --planned-addresses`). A GPU runs out on "
        "reserved memory, not on the plan's peak."
    )


def _device_text(d: str, e: ExpectedReserved) -> str:
    """One accelerator's part of reserved_text."""
    (low, high), grown, planned = e.default, e.expandable, e.planned
    return (
        f"{d}: predicted reserved {format_bytes(high.reserved)} (fragmentation {format_bytes(high.fragmentation)}; "
        f"the host a step ahead, the end planning fits to the budget), "
        f"reserved ~{_reserved(e.default)} over the plan's peak of "
        f"{format_bytes(low.plan_peak)} (the step adds {_span(low.step_reserved, high.step_reserved, format_bytes)} "
        f"reserved for {format_bytes(low.step_peak)} above the homed inputs)"
        + (f"; out of memory at {high.out_of_memory}" if high.out_of_memory else "")
        + f"; with expandable segments ~{_reserved(grown)}"
        + "; with planned addresses (--planned-addresses) "
        + (
            f"~{_reserved(planned)} (arena {format_bytes(e.arena_bytes)}, at most {format_bytes(e.outside)} outside it)"
            if e.arena_bytes
            else "the same: no value it makes can go in the arena (no `out=` overload, or no recorded dtype and layout)"
        )
    )


def _reserved(r: Range) -> str:
    """Reserved bytes and their share over the plan's peak, as ranges where the two ends differ."""
    return (
        f"{_span(r[0].reserved, r[1].reserved, format_bytes)}, "
        f"{_span(r[0].over_plan, r[1].over_plan, lambda x: f'{x:+.1%}')}"
    )


def _span(low: float, high: float, fmt: Callable[[Any], str]) -> str:
    return fmt(low) if fmt(low) == fmt(high) else f"{fmt(low)} to {fmt(high)}"
