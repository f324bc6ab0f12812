"""Measuring ops in rounds through the device plugins, within profiling's time cap.

Without a cap every device gets `rounds` passes over the signature groups (one on a simulated device), each pass
handed to Device.measure_ops at once. With a cap, work is cut into units (one op on a device that measures ops one
at a time, a chunk of ops on one that interleaves them), and a unit starts only when what the device took per op so
far, and what its ops are expected to take per call (timecap.OpWalls), says it ends before its deadline:
1. the first round (OpRounds.first): each device gets an equal share of the time left (what one leaves, the next
   gets), less what the caller reserves for later (measure.py: the largest values' copies);
2. the later rounds (OpRounds.later), on real devices, while units fit before the cap; a group still unmeasured
   goes first.
In every pass the full policy goes to as many ops as leave time for the others at the quick one.
A group left unmeasured gets no cost here (measure.profile_graph models it: fallback.py).
"""

from __future__ import annotations

import bisect
import itertools
import statistics
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from xsched.contracts.graph import Graph
from xsched.contracts.profile import OpCost
from xsched.devices.base import Device, Measurement, Policy
from xsched.profiling import timecap
from xsched.profiling.fallback import Roofline
from xsched.profiling.timecap import OpWalls, TimeCap

Key = tuple[str, ...]  # a signature group: the ids of its ops, the first one measured for all
Found = dict[Key, "list[Measurement] | str"]  # per group: its measurements over the rounds, or why it cannot run


class OpRounds:
    """Per device, per signature group: its measurements so far (none if the cap left it out) or why it cannot run."""

    def __init__(
        self,
        devices: Sequence[Device],
        graph: Graph,
        groups: Mapping[str, list[str]],
        policy: Policy,
        cap: TimeCap,
        progress: Callable[[int], Any],
    ) -> None:
        self.devices, self.graph, self.cap, self.progress = list(devices), graph, cap, progress
        self.found: dict[str, Found] = {d.name: {tuple(ids): [] for ids in groups.values()} for d in devices}
        self.walls = OpWalls(policy)

    def first(self, reserve_s: float = 0.0) -> None:
        """The first round on every device; with a cap, each an equal share of the time left less `reserve_s`
        (simulated devices first: they take little, and what they leave goes to the real ones)."""
        devices = sorted(self.devices, key=lambda d: not d.simulated)
        for i, d in enumerate(devices):
            share = (self.cap.left() - reserve_s) / (len(devices) - i)
            until = self.cap.spent() + share if self.cap.capped else None
            _measure_pass(d, self.graph, self.found[d.name], self.walls, self.cap, until, self.progress)

    def later(self, rounds: int) -> None:
        """Rounds 2..`rounds` on the real devices (a simulated one gives the same numbers again), within the cap."""
        for _ in range(1, rounds):
            for d in self.devices:
                if not d.simulated:
                    _measure_pass(d, self.graph, self.found[d.name], self.walls, self.cap, None, self.progress)


def _measure_pass(
    d: Device,
    graph: Graph,
    found: Found,
    walls: OpWalls,
    cap: TimeCap,
    until: float | None,
    progress: Callable[[int], Any],
) -> None:
    """One pass over the runnable groups of `d`, the least measured first, else in graph order, in units that fit
    before `until` and the cap; an op too slow for the time left is passed over for the smaller ones after it."""
    todo = sorted((k for k, ms in found.items() if not isinstance(ms, str)), key=lambda k: len(found[k]))
    one_at_a_time = type(d).measure_ops is Device.measure_ops  # an interleaving device times a chunk together
    while todo:
        unit: tuple[bool, int] | None = (False, len(todo))
        if cap.capped:
            costs, left = _op_estimates(graph, d, found, todo), cap.left(until)
            unit = _next_unit(walls, d.name, costs, left, one_at_a_time)
            if unit is None:  # not even the next op fits: a smaller one may (that one is modelled)
                if min(walls.per_op(d.name, True, t, b) for t, b in costs) > left:
                    break
                todo = todo[1:]
                continue
        quick, n = unit
        chunk, todo = todo[:n], todo[n:]
        t0 = timecap.clock()
        results = d.measure_ops(graph, [graph.op[k[0]] for k in chunk], walls.policy.quick() if quick else walls.policy)
        wall = timecap.clock() - t0
        call_s = sum(m.time_s for m in results if not isinstance(m, str))
        walls.record(d.name, quick, len(chunk), sum(_input_bytes(graph, k[0]) for k in chunk), call_s, wall)
        for key, m in zip(chunk, results, strict=True):
            if isinstance(m, str):
                found[key] = m
            else:
                found[key].append(m)  # type: ignore[union-attr]
        progress(len(chunk))


def _input_bytes(graph: Graph, op: str) -> int:
    """Bytes of the inputs a plugin makes to measure `op` (op_input_tensors)."""
    return sum(graph.value[v].nbytes for v in dict.fromkeys(graph.op[op].inputs))


def _op_estimates(graph: Graph, d: Device, found: Found, todo: Sequence[Key]) -> list[tuple[float, int]]:
    """Per group of `todo`: its time per call on `d` (measured in an earlier round, else modelled from what `d`
    reached so far: fallback.Roofline, so that a large op is expected to take longer than a small one), and the
    bytes of its inputs."""
    measured = {
        k[0]: statistics.median(m.time_s for m in ms) for k, ms in found.items() if ms and not isinstance(ms, str)
    }
    model = Roofline(graph, d, {o: OpCost(t) for o, t in measured.items()})
    return [(measured[k[0]] if k[0] in measured else model.time_s(k[0]), _input_bytes(graph, k[0])) for k in todo]


def _next_unit(
    walls: OpWalls, device: str, ops: Sequence[tuple[float, int]], left: float, one_at_a_time: bool
) -> tuple[bool, int] | None:
    """(quick policy?, ops) for the next call of measure_ops over `ops` (each its time per call and input bytes), or
    None when not even the first fits in `left` seconds.

    The full policy for as many ops as leave time for the others at the quick one; an interleaving device gets
    chunks of about half the time left, so that the next check comes in time."""
    full = [walls.per_op(device, False, t, b) for t, b in ops]
    quick = [walls.per_op(device, True, t, b) for t, b in ops]
    quick_after = list(itertools.accumulate(reversed(quick), initial=0.0))[::-1]  # quick_after[i] = sum(quick[i:])

    def chunk(est: list[float]) -> int:
        if one_at_a_time:
            return 1
        spent = list(itertools.accumulate(est))
        return max(1, bisect.bisect_right(spent, left / 2))

    n = chunk(full)
    spent_full = list(itertools.accumulate(full[:n]))
    while n and spent_full[n - 1] + quick_after[n] > left:
        n -= 1
    if n:
        return False, n
    n = chunk(quick)
    return (True, n) if sum(quick[:n]) <= left else None
