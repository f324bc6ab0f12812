"""The chains through each op on each device, whatever the plan: the earliest any run of an op can start there (its
inputs made on the fastest route, copies at their links' time, relays included) and the least time from its end to
the step's end (its readers on their best devices, outputs that must end on a home moved there). Memory, the links'
queues and the compute lanes only make a plan later, so no plan does better: the time bounds build on these."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from xsched.contracts.graph import Graph
from xsched.contracts.plan import required_homes
from xsched.contracts.profile import Profile


@dataclass(frozen=True)
class Chains:
    """`head[d][op]`: the earliest a run of op on d can start; `tail[d][op]`: the least time from its end there to
    the step's end; `time[d][op]`: its time on d (inf where d cannot run it)."""

    head: Mapping[str, Mapping[str, float]]
    tail: Mapping[str, Mapping[str, float]]
    time: Mapping[str, Mapping[str, float]]

    def through(self, op: str, device: str) -> float:
        """The shortest step in which op runs on `device` alone: its earliest start, its time, the rest after it."""
        return self.head[device][op] + self.time[device][op] + self.tail[device][op]


def chains(graph: Graph, profile: Profile, devices: Sequence[str], homes: Mapping[str, str]) -> Chains:
    """Every op's chains on every device (graph order is topological)."""
    time = {d: {o.id: _time(profile, o.id, d) for o in graph.ops} for d in devices}
    for o in graph.ops:  # an op no device runs: free everywhere, which only weakens the bounds (reach says why)
        if all(math.isinf(time[d][o.id]) for d in devices):
            for d in devices:
                time[d][o.id] = 0.0
    move = _Moves(graph, profile, devices)
    head: dict[str, dict[str, float]] = {d: {} for d in devices}
    for o in graph.ops:
        for d in devices:
            head[d][o.id] = max(
                (_arrival(graph, v, d, head, time, move, homes, devices) for v in o.inputs), default=0.0
            )
    ends = required_homes(graph, homes)
    tail: dict[str, dict[str, float]] = {d: {} for d in devices}
    for o in reversed(graph.ops):
        for d in devices:
            after = 0.0
            for v in o.outputs:
                for c in dict.fromkeys(graph.consumers.get(v, ())):
                    after = max(after, min(move(v, d, e) + time[e][c] + tail[e][c] for e in devices))
                if v in ends:
                    after = max(after, move(v, d, ends[v]))
            tail[d][o.id] = after
    return Chains(head, tail, time)


def _time(profile: Profile, op: str, device: str) -> float:
    cost = profile.op_cost(op, device)
    return cost.time_s if cost is not None else math.inf


def _arrival(graph, value, device, head, time, move, homes, devices) -> float:
    """The earliest `value` can be on `device`: made there or elsewhere and moved, or moved from its home."""
    p = graph.producer.get(value)
    if p is None:
        home = homes.get(value)  # no home (or one outside the plan's devices): anywhere, from the start
        return move(value, home, device) if home in devices else 0.0
    return min(head[e][p] + time[e][p] + move(value, e, device) for e in devices)


class _Moves:
    """Seconds to bring a value from one device to another over the links (0 on the same device, inf without a
    route): the shortest route, relays through other devices included, each copy at its link's time."""

    def __init__(self, graph: Graph, profile: Profile, devices: Sequence[str]) -> None:
        self.graph, self.profile, self.devices = graph, profile, list(devices)
        self._routes: dict[str, dict[tuple[str, str], float]] = {}

    def __call__(self, value: str, src: str, dst: str) -> float:
        if src == dst:
            return 0.0
        routes = self._routes.get(value)
        if routes is None:
            routes = self._routes[value] = self._shortest(value)
        return routes.get((src, dst), math.inf)

    def _shortest(self, value: str) -> dict[tuple[str, str], float]:
        nbytes, ds = self.graph.value[value].nbytes, self.devices
        dist: dict[tuple[str, str], float] = {}
        for a in ds:
            for b in ds:
                t = self.profile.copy_time(value, nbytes, a, b) if a != b else 0.0
                dist[a, b] = math.inf if t is None else t
        for k in ds:  # Floyd-Warshall: a handful of devices
            for a in ds:
                for b in ds:
                    if dist[a, k] + dist[k, b] < dist[a, b]:
                        dist[a, b] = dist[a, k] + dist[k, b]
        return dist
