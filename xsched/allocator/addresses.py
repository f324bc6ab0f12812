"""Planned addresses (MODeL's address assignment, with the plan's order fixed): every value a device allocates during
the step gets a byte offset inside one arena per device, so that two residencies live at the same time never share
a byte.

A residency is one stay of a value on a device: from the step that makes it resident there (a compute's output, a
copy's destination) to the step that frees it. Graph inputs homed on the device (there before the step) and values
still resident at the end (they outlive the step: the caller reads them) are not in the arena, nor is any residency
the caller's `in_arena` leaves out (the executor keeps out what it cannot place: ops without an `out=` variant,
random ops, views). Offsets come from greedy-by-size (largest first, at the lowest offset clear of the placed
residencies that overlap it in time, as TFLite's and ExecuTorch's memory planners do; two other orders are tried
too, GREEDY_ORDERS), then optionally from CP-SAT
(`AddNoOverlap2D` over fixed time intervals and free offsets, minimising the arena, greedy as the hint).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from xsched.contracts.graph import Graph
from xsched.contracts.plan import Compute, Copy, Free, Plan

ALIGNMENT = 512  # bytes: the CUDA caching allocator's rounding of every block


@dataclass(frozen=True)
class Residency:
    """`value` resident on `device` from step `start` to step `end` (both inclusive: the value is live while they
    run). `start` is -1 for a homed graph input, `end` is len(steps) for a value still resident at the end."""

    value: str
    device: str
    start: int
    end: int
    nbytes: int

    @property
    def key(self) -> tuple[str, str, int]:
        return (self.value, self.device, self.start)

    def overlaps(self, other: Residency) -> bool:
        """True when the two are live during a common step."""
        return self.start <= other.end and other.start <= self.end


@dataclass(frozen=True)
class Addresses:
    """The offsets of a plan's arena residencies and what each device then holds. `offsets`: (value, device, start
    step) -> byte offset in that device's arena; `arena_bytes`: each device's arena; `lower_bound`: the most
    (aligned) arena bytes live at one step, which no assignment can beat; `outside_peak`: the most bytes live at one
    step outside the arena and the homed inputs; `homed`: the homed inputs' bytes; `method`: "greedy", or CP-SAT's
    "optimal" / "feasible" when it improved on (or proved) greedy."""

    offsets: Mapping[tuple[str, str, int], int]
    sizes: Mapping[tuple[str, str, int], int]
    arena_bytes: Mapping[str, int]
    lower_bound: Mapping[str, int]
    outside_peak: Mapping[str, int]
    homed: Mapping[str, int]
    method: str

    def predicted_peak(self, device: str) -> int:
        """What the device holds at its fullest with planned addresses: homed inputs, the whole arena (allocated
        once), and the most bytes live outside it."""
        return self.homed.get(device, 0) + self.arena_bytes.get(device, 0) + self.outside_peak.get(device, 0)


def residencies(graph: Graph, plan: Plan) -> list[Residency]:
    """Every residency of the plan in the order they begin (homed inputs first), as the plan semantics count them: a
    compute of a value already resident on its device (recomputed while held) begins none."""
    nbytes = {v.id: v.nbytes for v in graph.values}
    open_: dict[tuple[str, str], int] = {(v, d): -1 for v, d in plan.homes.items()}
    done: list[Residency] = []
    for i, s in enumerate(plan.steps):
        if isinstance(s, Compute):
            for v in graph.op[s.op].outputs:
                open_.setdefault((v, s.device), i)
        elif isinstance(s, Copy):
            open_.setdefault((s.value, s.dst), i)
        elif isinstance(s, Free):
            start = open_.pop((s.value, s.device))
            done.append(Residency(s.value, s.device, start, i, nbytes[s.value]))
    end = len(plan.steps)
    done += [Residency(v, d, start, end, nbytes[v]) for (v, d), start in open_.items()]
    return sorted(done, key=lambda r: (r.start, r.end, r.device, r.value))


def aligned(n: int, alignment: int = ALIGNMENT) -> int:
    return -(-n // alignment) * alignment


def plan_addresses(
    graph: Graph,
    plan: Plan,
    in_arena: Callable[[Residency], bool] | None = None,
    sizes: Mapping[str, int] | None = None,
    *,
    alignment: int = ALIGNMENT,
    time_limit_s: float = 0.0,
    to_the_end: bool = False,
) -> Addresses:
    """Offsets for the plan's arena residencies: those made during the step and freed in it, that `in_arena` keeps
    (default all). `sizes`: a value's bytes in its slot where they differ from its graph bytes (a strided layout
    spans more). With `time_limit_s` > 0, CP-SAT improves on greedy for that long. `to_the_end`: values still resident
    at the end may be placed too (their slots live to the end of the step: the caller reads them before the next)."""
    steps = len(plan.steps)
    every = residencies(graph, plan)
    arena: list[Residency] = []
    outside: list[Residency] = []
    homed: dict[str, int] = {}
    for r in every:
        if r.start < 0:
            homed[r.device] = homed.get(r.device, 0) + r.nbytes
        elif (r.end < steps or to_the_end) and (in_arena is None or in_arena(r)):
            arena.append(r)
        else:
            outside.append(r)
    size = {r.key: aligned((sizes or {}).get(r.value, r.nbytes), alignment) for r in arena}
    offsets = best_greedy(arena, size)
    method = "greedy"
    if time_limit_s > 0 and arena:
        offsets, method = cpsat_offsets(arena, size, offsets, alignment, time_limit_s)
    devices = plan.devices
    top = {d: max((offsets[r.key] + size[r.key] for r in arena if r.device == d), default=0) for d in devices}
    return Addresses(
        offsets=offsets,
        sizes=size,
        arena_bytes=top,
        lower_bound=_most_live(arena, {r.key: size[r.key] for r in arena}, devices, steps),
        outside_peak=_most_live(outside, {r.key: r.nbytes for r in outside}, devices, steps),
        homed=homed,
        method=method,
    )


# the orders greedy places residencies in, each tried: largest first (TFLite's greedy by size), largest area (bytes
# times steps) first, earliest first (a stack-like order fits plans that free in reverse)
GREEDY_ORDERS = {
    "size": lambda r, n: (-n, r.start, r.value),
    "area": lambda r, n: (-n * (r.end - r.start + 1), r.start, r.value),
    "start": lambda r, n: (r.start, -n, r.value),
}


def best_greedy(arena: list[Residency], size: Mapping[tuple[str, str, int], int]) -> dict[tuple[str, str, int], int]:
    """Per device, the smallest arena of greedy over GREEDY_ORDERS, each placing first fit and best fit."""
    tops: dict[str, int] = {}
    best: dict[tuple[str, str, int], int] = {}
    for order, tightest in ((o, t) for o in GREEDY_ORDERS for t in (False, True)):
        offsets = greedy_offsets(arena, size, order, tightest)
        for dev in {r.device for r in arena}:
            rs = [r for r in arena if r.device == dev]
            top = max(offsets[r.key] + size[r.key] for r in rs)
            if top < tops.get(dev, top + 1):
                tops[dev] = top
                best.update({r.key: offsets[r.key] for r in rs})
    return best


def greedy_offsets(
    arena: list[Residency], size: Mapping[tuple[str, str, int], int], order: str = "size", tightest: bool = False
) -> dict[tuple[str, str, int], int]:
    """In `order` (GREEDY_ORDERS; default largest first, ties earliest), each at the lowest offset clear of every
    placed residency of its device that overlaps it in time (first fit), or with `tightest` in the smallest gap between
    them that holds it (best fit; above them all when none does)."""
    placed: dict[str, list[tuple[Residency, int]]] = {}
    offsets: dict[tuple[str, str, int], int] = {}
    key = GREEDY_ORDERS[order]
    for r in sorted(arena, key=lambda r: key(r, size[r.key])):
        n = size[r.key]
        taken = sorted((o, o + size[q.key]) for q, o in placed.get(r.device, ()) if q.overlaps(r))
        gaps: list[tuple[int, int]] = []  # (gap bytes, its offset) of every gap that holds r, below the top
        at = 0
        for lo, hi in taken:
            if lo >= at + n:
                gaps.append((lo - at, at))
                if not tightest:
                    break
            at = max(at, hi)
        if gaps:
            at = min(gaps)[1] if tightest else gaps[0][1]
        offsets[r.key] = at
        placed.setdefault(r.device, []).append((r, at))
    return offsets


def _most_live(rs: list[Residency], size: Mapping[tuple[str, str, int], int], devices, steps: int) -> dict[str, int]:
    """Per device: the most bytes of `rs` live during one step."""
    delta: dict[str, list[int]] = {d: [0] * (steps + 2) for d in devices}
    for r in rs:
        d = delta.setdefault(r.device, [0] * (steps + 2))
        d[max(r.start, 0)] += size[r.key]
        d[min(r.end, steps) + 1] -= size[r.key]
    out = {}
    for dev, d in delta.items():
        live = best = 0
        for x in d:
            live += x
            best = max(best, live)
        out[dev] = best
    return out


def cpsat_offsets(
    arena: list[Residency],
    size: Mapping[tuple[str, str, int], int],
    greedy: dict[tuple[str, str, int], int],
    alignment: int,
    time_limit_s: float,
) -> tuple[dict[tuple[str, str, int], int], str]:
    """CP-SAT per device: offsets in units of `alignment`, time intervals fixed, the arena's top minimised; greedy as
    the hint and the upper bound. Returns greedy unchanged (method "greedy") if CP-SAT finds nothing better and does
    not prove it optimal."""
    from ortools.sat.python import cp_model

    offsets = dict(greedy)
    verdicts = []
    for dev in sorted({r.device for r in arena}):
        rs = [r for r in arena if r.device == dev]
        units = {r.key: size[r.key] // alignment for r in rs}
        top_greedy = max(greedy[r.key] // alignment + units[r.key] for r in rs)
        m = cp_model.CpModel()
        top = m.NewIntVar(0, top_greedy, "top")  # the arena's size, in alignment units
        xs, xi, ti = {}, [], []
        for r in rs:
            # offset of each residency (its byte interval) and its fixed time interval [start, end]
            x = xs[r.key] = m.NewIntVar(0, top_greedy - units[r.key], f"x{len(xs)}")
            xi.append(m.NewFixedSizeIntervalVar(x, units[r.key], f"bytes{len(xs)}"))
            ti.append(m.NewFixedSizeIntervalVar(r.start, r.end - r.start + 1, f"time{len(xs)}"))
            m.Add(x + units[r.key] <= top)  # the arena holds every slot
            m.AddHint(x, greedy[r.key] // alignment)
        m.AddNoOverlap2D(xi, ti)  # residencies live at one step never share bytes
        m.Minimize(top)
        solver = cp_model.CpSolver()
        solver.parameters.max_time_in_seconds = time_limit_s
        solver.parameters.num_workers = 1
        status = solver.Solve(m)
        if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            verdicts.append("greedy")
            continue
        if solver.Value(top) < top_greedy:
            offsets.update({k: solver.Value(x) * alignment for k, x in xs.items()})
        verdicts.append("optimal" if status == cp_model.OPTIMAL else "feasible")
    method = (
        "optimal" if all(v == "optimal" for v in verdicts) else ("feasible" if "feasible" in verdicts else "greedy")
    )
    return offsets, method
