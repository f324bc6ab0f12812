"""Planned addresses (MODeL's address assignment, with the plan's order fixed): every value a device allocates during
the step gets a byte offset inside one arena per device, so that two residencies live at the same time never share
a byte.

A residency is one stay of a value on a device: from the step that makes it resident there (a compute's output, a
copy's destination) to the step that frees it. Graph inputs homed on the device (there before the step) and values
still resident at the end (they outlive the step: the caller reads them) are not in the arena, nor is any residency
the caller's `in_arena` leaves out (the executor keeps out what it cannot place: ops without an `out=` variant,
random ops, views). Offsets come from greedy-by-size (largest first, at the lowest offset clear of the placed
residencies that overlap it in time, as TFLite's and ExecuTorch's memory planners do; two other orders are tried
too, GREEDY_ORDERS), improved by an iterated greedy within a fixed amount of work (xsched.allocator.arena_search: the
same offsets on every run), then optionally by CP-SAT (`AddNoOverlap2D` over fixed time intervals and free offsets,
minimising the arena, the search's offsets as the hint, the most bytes live at one step as its bound).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from xsched.allocator.arena_search import SEARCH_WORK, improve, most_live, overlapping, place
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
    step outside the arena and the homed inputs, op workspaces included; `homed`: the homed inputs' bytes; `method`: "greedy", "search" where
    the iterated greedy (arena_search) found a smaller arena, or CP-SAT's "optimal" / "feasible" when it ran and found
    a solution (proven optimal or not); `temporary`: compute step -> bytes it allocates beside the arena besides its
    workspace (a composite `out=`'s functional outputs, before they are copied into their slots)."""

    offsets: Mapping[tuple[str, str, int], int]
    sizes: Mapping[tuple[str, str, int], int]
    arena_bytes: Mapping[str, int]
    lower_bound: Mapping[str, int]
    outside_peak: Mapping[str, int]
    homed: Mapping[str, int]
    method: str
    temporary: Mapping[int, int] = field(default_factory=dict)

    def predicted_peak(self, device: str) -> int:
        """What the device holds at its fullest with planned addresses: homed inputs, the whole arena (allocated
        once), and the most bytes live outside it (an op's workspace among them: the op allocates it itself)."""
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
    search_work: int = SEARCH_WORK,
    scratch: Mapping[int, tuple[str, int]] | None = None,
) -> Addresses:
    """Offsets for the plan's arena residencies: those made during the step and freed in it, that `in_arena` keeps
    (default all). `sizes`: a value's bytes in its slot where they differ from its graph bytes (a strided layout
    spans more). Greedy's best, improved by the iterated greedy (arena_search) within `search_work` (0: greedy alone).
    With `time_limit_s` > 0 the search runs for half of it (no work bound) and CP-SAT improves on it for the rest.
    `to_the_end`: values still resident at the end may be placed too (their slots live to the end of the step: the
    caller reads them before the next). `scratch`: step -> (device, bytes) an op allocates inside and frees before it
    returns (its workspace): never in the arena (the op allocates it itself), so it counts once, outside, during its
    step only."""
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
    outside += [Residency(f"scratch@{i}", d, i, i, n) for i, (d, n) in (scratch or {}).items() if n > 0]
    size = {r.key: aligned((sizes or {}).get(r.value, r.nbytes), alignment) for r in arena}
    runs = greedy_runs(arena, size)
    greedy = _smallest_per_device(arena, size, runs.values())
    offsets, method = greedy, "greedy"
    if arena and (search_work > 0 or time_limit_s > 0):
        deadline = time.perf_counter() + time_limit_s / 2 if time_limit_s > 0 else None
        offsets = searched_offsets(arena, size, search_work if deadline is None else 1 << 62, deadline, runs)
        method = "search" if _tops(arena, size, offsets) != _tops(arena, size, greedy) else method
    if time_limit_s > 0 and arena:
        offsets, solved = cpsat_offsets(arena, size, offsets, alignment, time_limit_s / 2)
        method = solved if solved != "greedy" else method
    devices = plan.devices
    top = {d: _tops(arena, size, offsets).get(d, 0) for d in devices}
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
    return _smallest_per_device(arena, size, greedy_runs(arena, size).values())


def greedy_runs(
    arena: list[Residency], size: Mapping[tuple[str, str, int], int]
) -> dict[tuple[str, bool], dict[tuple[str, str, int], int]]:
    """(order, best fit) -> greedy's offsets, for every order of GREEDY_ORDERS, first fit and best fit."""
    devices = _per_device(arena, size)
    return {(o, t): _greedy(devices, size, o, t) for o in GREEDY_ORDERS for t in (False, True)}


def _smallest_per_device(arena, size, runs) -> dict[tuple[str, str, int], int]:
    """Per device, the offsets of the run (offsets of every residency) with the smallest arena there."""
    tops: dict[str, int] = {}
    best: dict[tuple[str, str, int], int] = {}
    for offsets in runs:
        for dev in {r.device for r in arena}:
            rs = [r for r in arena if r.device == dev]
            top = max(offsets[r.key] + size[r.key] for r in rs)
            if top < tops.get(dev, top + 1):
                tops[dev] = top
                best.update({r.key: offsets[r.key] for r in rs})
    return best


def searched_offsets(
    arena: list[Residency],
    size: Mapping[tuple[str, str, int], int],
    work: int = SEARCH_WORK,
    deadline: float | None = None,
    runs: Mapping[tuple[str, bool], Mapping[tuple[str, str, int], int]] | None = None,
) -> dict[tuple[str, str, int], int]:
    """Greedy's best per device (best_greedy; `runs`: greedy_runs' when already made), then where that is above the
    most bytes live at one step, the iterated greedy of xsched.allocator.arena_search from the order whose best fit
    gave the smallest arena, where it finds a smaller one (same `work`, same offsets)."""
    runs = runs if runs is not None else greedy_runs(arena, size)
    offsets = _smallest_per_device(arena, size, runs.values())
    for d in _per_device(arena, size):
        top = max(offsets[r.key] + size[r.key] for r in d.rs)
        if top <= most_live(d.spans):  # greedy met the bound: nothing to search
            continue
        name = min(GREEDY_ORDERS, key=lambda o: max(runs[o, True][r.key] + size[r.key] for r in d.rs))
        found, found_top = improve(d.spans, d.order(name), d.near, work=work, deadline=deadline)
        if found_top < top:
            offsets.update({r.key: o for r, o in zip(d.rs, found)})
    return offsets


def greedy_offsets(
    arena: list[Residency], size: Mapping[tuple[str, str, int], int], order: str = "size", tightest: bool = False
) -> dict[tuple[str, str, int], int]:
    """In `order` (GREEDY_ORDERS; default largest first, ties earliest), each at the lowest offset clear of every
    placed residency of its device that overlaps it in time (first fit), or with `tightest` in the smallest gap between
    them that holds it (best fit; above them all when none does)."""
    return _greedy(_per_device(arena, size), size, order, tightest)


class _Device:
    """One device's arena residencies with what every placement reads: their spans and who overlaps whom."""

    def __init__(self, rs: list[Residency], size: Mapping[tuple[str, str, int], int]):
        self.rs = rs
        self.spans = [(r.start, r.end, size[r.key]) for r in rs]
        self.near = overlapping(self.spans)

    def order(self, name: str) -> list[int]:
        """Indices of the residencies in the GREEDY_ORDERS order `name`."""
        key = GREEDY_ORDERS[name]
        return sorted(range(len(self.rs)), key=lambda k: key(self.rs[k], self.spans[k][2]))


def _per_device(arena: list[Residency], size: Mapping[tuple[str, str, int], int]) -> list[_Device]:
    devices: dict[str, list[Residency]] = {}
    for r in arena:
        devices.setdefault(r.device, []).append(r)
    return [_Device(rs, size) for _, rs in sorted(devices.items())]


def _greedy(devices: list[_Device], size, order: str, tightest: bool) -> dict[tuple[str, str, int], int]:
    offsets: dict[tuple[str, str, int], int] = {}
    for d in devices:
        placed = place(d.order(order), [n for _, _, n in d.spans], d.near, tightest)
        offsets.update({r.key: o for r, o in zip(d.rs, placed)})
    return offsets


def _tops(arena: list[Residency], size: Mapping[tuple[str, str, int], int], offsets) -> dict[str, int]:
    """Per device: the arena the offsets need (the highest slot's end)."""
    top: dict[str, int] = {}
    for r in arena:
        top[r.device] = max(top.get(r.device, 0), offsets[r.key] + size[r.key])
    return top


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
        floor = _most_live(rs, units, [dev], max(r.end for r in rs) + 1)[dev]
        m = cp_model.CpModel()
        # the arena's size, in alignment units: at least the most live at one step (the bound CP-SAT may then prove)
        top = m.NewIntVar(min(floor, top_greedy), top_greedy, "top")
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
