"""A compiled plan's peak per device: the plan walked with each compiled region counted as measured (the most bytes
it allocated above what was resident when it began) instead of by its steps' per-op counts."""

from __future__ import annotations

from collections.abc import Mapping

from xsched.contracts.graph import Graph, Op
from xsched.contracts.plan import Compute, Free, Plan
from xsched.interpret import PlanInterpreter


def compiled_peaks(graph: Graph, plan: Plan, peaks: Mapping[tuple[int, ...], int]) -> dict[str, int]:
    """The plan's peak per device with each measured region (its steps -> the most bytes it allocated above what
    was resident when it began) counted as measured instead of by its steps' per-op counts."""
    return _CompiledPeaks(graph, plan, peaks).run()


def region_peaks(
    graph: Graph, plan: Plan, peaks: Mapping[tuple[int, ...], int]
) -> dict[tuple[int, ...], tuple[str, int]]:
    """Each measured region (its steps) -> its device and the bytes there at its peak: what the plan holds when the
    region begins plus the most the region allocated above that."""
    walk = _CompiledPeaks(graph, plan, peaks)
    walk.run()
    return walk.at


class _CompiledPeaks(PlanInterpreter):
    def __init__(self, graph: Graph, plan: Plan, peaks: Mapping[tuple[int, ...], int]) -> None:
        super().__init__(graph, plan)
        self.inside = {i: steps for steps in peaks for i in steps}
        self.first = {steps[0]: (steps, extra) for steps, extra in peaks.items()}
        self.at: dict[tuple[int, ...], tuple[str, int]] = {}  # region steps -> (device, its peak)

    def bump(self, i: int, device: str, during: int, **where: str) -> None:
        if i not in self.inside:
            super().bump(i, device, during, **where)

    def on_compute(self, i: int, s: Compute, op: Op) -> None:
        self._enter(i, s.device)

    def on_free(self, i: int, s: Free) -> None:
        self._enter(i, s.device)

    def _enter(self, i: int, device: str) -> None:
        if i in self.first:  # a region begins: what is resident now plus what it allocated, at most
            steps, extra = self.first[i]
            self.at[steps] = (device, self.used[device] + extra)
            super().bump(i, device, self.used[device] + extra)

    def end(self) -> dict[str, int]:
        return dict(self.peak)
