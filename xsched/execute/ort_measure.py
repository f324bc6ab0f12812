"""Measuring a placed ONNX run beside a plain ONNX Runtime session on the same providers and the simulator's
prediction: times, peaks, and how far the outputs differ."""

from __future__ import annotations

import statistics
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from xsched.budgets import format_bytes
from xsched.contracts.graph import Graph
from xsched.contracts.onnx_ops import example_array, require
from xsched.contracts.plan import Plan
from xsched.contracts.profile import Profile
from xsched.errors import XschedError
from xsched.execute.ort_executor import OrtExecutor, plain_session
from xsched.execute.run_report import warm_up
from xsched.simulate import simulate


@dataclass(frozen=True)
class OnnxRunReport:
    """Median wall times of the placed run and of one plain session (interleaved, after warm-up), predictions,
    peaks (the plan's and the executor's accounting, in graph bytes) and the largest output difference."""

    graph: str
    method: str
    iters: int
    time_s: float
    plain_time_s: float
    predicted_time_s: float | None
    predicted_makespan_s: float | None
    predicted_peak_bytes: Mapping[str, int]
    peak_bytes: Mapping[str, int]
    budgets: Mapping[str, int]
    segments: int
    sessions: int
    max_abs_diff: float
    predicted_from: str

    def table(self) -> str:
        def ms(x: float | None) -> str:
            return "-" if x is None else f"{x * 1e3:.3f} ms"

        lines = [
            f"{self.graph}: plan {self.method}, {self.segments} segments on {self.sessions} sessions; "
            f"predictions from {self.predicted_from}",
            f"  time      predicted {ms(self.predicted_time_s)} seq / {ms(self.predicted_makespan_s)} overlap; "
            f"measured {ms(self.time_s)} placed, {ms(self.plain_time_s)} plain session "
            f"(x{self.time_s / self.plain_time_s:.3f}; median of {self.iters})",
        ]
        for d, b in self.peak_bytes.items():
            budget = self.budgets.get(d)
            of = f" of budget {format_bytes(budget)}" if budget is not None else ""
            lines.append(
                f"  peak {d:<12} plan {format_bytes(self.predicted_peak_bytes.get(d, 0))}, executor "
                f"{format_bytes(b)}{of}"
            )
        lines.append(f"  outputs   largest difference from the plain session {self.max_abs_diff:.3g}")
        return "\n".join(lines)


def example_feeds(graph: Graph, seed: int = 0) -> dict[str, Any]:
    """Arrays for the graph's model inputs: normal floats, zeros for integers (token ids, indices)."""
    np = require("numpy", "execute")
    rng = np.random.default_rng(seed)
    return {v: example_array(graph, v, rng) for v in graph.inputs if graph.value[v].kind == "input"}


def measure_onnx(
    graph: Graph,
    plan: Plan,
    model: Any,
    feeds: Mapping[str, Any] | None = None,
    profile: Profile | None = None,
    *,
    iters: int = 10,
    warmup: int | None = None,
    optimization: str = "all",
    predicted_from: str | None = None,
) -> OnnxRunReport:
    """Run the plan and a plain session of `model` on the plan's providers with `feeds` (default example_feeds),
    alternating: `warmup` times each (default: until their run times settle), then `iters` times measured."""
    np = require("numpy", "execute")
    if iters < 1:
        raise XschedError(f"iters must be at least 1, got {iters}", stage="execute")
    feeds = dict(feeds) if feeds is not None else example_feeds(graph)
    sim = simulate(graph, plan, profile, check_budgets=False)
    ex = OrtExecutor(graph, plan, model, optimization=optimization)
    plain = plain_session(model, list(ex.device_names.values()), optimization)
    names = [o.name for o in plain.get_outputs()]

    def placed() -> Any:
        return ex.run(feeds)

    def ordinary() -> Any:
        return plain.run(None, feeds)

    got, want = ex(feeds), dict(zip(names, ordinary()))
    diff = max(
        (float(np.max(np.abs(got[k].astype(np.float64) - want[k]))) if got[k].size else 0.0 for k in want), default=0.0
    )
    warm_up(lambda: (placed(), ordinary()), warmup)
    times: dict[str, list[float]] = {"placed": [], "plain": []}
    for _ in range(iters):
        for key, call in (("placed", placed), ("plain", ordinary)):
            t0 = time.perf_counter()
            call()
            times[key].append(time.perf_counter() - t0)
    return OnnxRunReport(
        graph=graph.name,
        method=plan.solver.method,
        iters=iters,
        time_s=statistics.median(times["placed"]),
        plain_time_s=statistics.median(times["plain"]),
        predicted_time_s=sim.time_s,
        predicted_makespan_s=sim.makespan_s,
        predicted_peak_bytes=dict(sim.peak_bytes),
        peak_bytes=ex.peak_bytes,
        budgets=dict(plan.budgets),
        segments=len(ex.segments),
        sessions=len(set(map(id, ex.sessions.values()))),
        max_abs_diff=diff,
        predicted_from=predicted_from or ("the profile" if profile else "no profile"),
    )
