"""Measuring a plan on real devices: `measure` runs it and returns a RunReport (measured beside predicted)."""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from xsched.budgets import format_bytes
from xsched.contracts.graph import Graph
from xsched.contracts.plan import Plan
from xsched.contracts.profile import Profile
from xsched.devices.base import relative_spread
from xsched.errors import XschedError
from xsched.execute.compiled_walk import compiled_peaks
from xsched.execute.executor import Executor
from xsched.simulate import simulate


@dataclass(frozen=True)
class RunReport:
    """Measured figures of a plan beside the simulator's predictions for it.

    time_s: median wall time of one run of the whole plan (one training iteration), measured after `warmup_iters`
    runs that brought the step time to a steady state; spread: (q3 - q1) / median of the measured runs. peak_bytes
    per device:
    torch.cuda.max_memory_allocated on CUDA, the executor's resident-byte accounting on CPU (peak_source says
    which). energy_j: measured (NVML, RAPL) where readable, else the profile's model; energy_source says which.
    """

    graph: str
    method: str
    iters: int
    time_s: float
    times_s: tuple[float, ...]
    peak_bytes: Mapping[str, int]
    peak_source: Mapping[str, str]
    energy_j: float | None
    energy_source: str
    predicted_time_s: float | None
    predicted_makespan_s: float | None
    predicted_peak_bytes: Mapping[str, int]
    predicted_energy_j: float | None
    predicted_from: str = "no profile"
    warmup_iters: int = 0
    spread: float = 0.0

    def as_dict(self) -> dict:
        """The report as JSON-ready data (a spread of one run, undefined, is None)."""
        out = dataclasses.asdict(self)
        out["spread"] = self.spread if math.isfinite(self.spread) else None
        return out

    def table(self) -> str:
        """Predicted vs measured, one row per figure."""

        def secs(x: float | None) -> str:
            return "-" if x is None else f"{x * 1e3:.3f} ms"

        rows = [
            (
                "iteration time",
                f"{secs(self.predicted_time_s)} seq / {secs(self.predicted_makespan_s)} overlap",
                f"{secs(self.time_s)} (median of {self.iters} after {self.warmup_iters} warm-up, spread "
                f"{100 * self.spread:.1f}%)",
            ),
        ]
        for d, b in self.peak_bytes.items():
            want = self.predicted_peak_bytes.get(d)
            rows.append(
                (f"peak {d}", "-" if want is None else format_bytes(want), f"{format_bytes(b)} ({self.peak_source[d]})")
            )
        energy = "-" if self.energy_j is None else f"{self.energy_j:.4g} J ({self.energy_source})"
        predicted = "-" if self.predicted_energy_j is None else f"{self.predicted_energy_j:.4g} J"
        rows.append(("energy", predicted, energy))
        w0 = max(len(r[0]) for r in rows)
        w1 = max(len(r[1]) for r in rows + [("", "predicted", "")])
        lines = [
            f"{self.graph}: plan {self.method}; predictions from {self.predicted_from}",
            f"{'':<{w0}}  {'predicted':>{w1}}  measured",
        ]
        lines += [f"{a:<{w0}}  {b:>{w1}}  {c}" for a, b, c in rows]
        return "\n".join(lines)


def _sync(ex: Executor) -> None:
    for d in set(ex.dev.values()):
        if d.type == "cuda":
            torch.cuda.synchronize(d)


class _Energy:
    """Measured energy over a span: NVML on the plan's GPUs, RAPL on the CPU package when it is readable."""

    def __init__(self, ex: Executor) -> None:
        from xsched.devices.energy import nvml_energy_mj, nvml_handle, rapl

        self.gpus = [nvml_handle(d.index or 0) for d in set(ex.dev.values()) if d.type == "cuda"]
        self.read_gpu = nvml_energy_mj
        self.rapl = rapl() if any(d.type == "cpu" for d in ex.dev.values()) else None
        self.ok = all(h is not None and nvml_energy_mj(h) is not None for h in self.gpus) and (
            self.rapl is None or self.rapl.available
        )
        self.source = "+".join(["nvml"] * bool(self.gpus) + ["rapl"] * bool(self.rapl and self.rapl.available))

    def snapshot(self) -> tuple:
        return tuple(self.read_gpu(h) for h in self.gpus), self.rapl.snapshot() if self.rapl else ()

    def joules(self, a: tuple, b: tuple) -> float:
        gpu = sum((y - x) / 1e3 for x, y in zip(a[0], b[0]))
        return gpu + (self.rapl.joules(a[1], b[1]) if self.rapl else 0.0)


def measure(
    graph: Graph,
    plan: Plan,
    env: Mapping[str, torch.Tensor],
    profile: Profile | None = None,
    *,
    iters: int = 10,
    warmup: int | None = None,
    devices: Mapping[str, torch.device | str] | None = None,
    predicted_from: str | None = None,
    compile: bool = False,
    expandable_segments: bool = False,
    planned_addresses: bool | str = False,
) -> RunReport:
    """Run the whole plan with inputs `env` until its time settles (or `warmup` times when given), then `iters` times
    measured; measured figures beside the predicted. `expandable_segments`, `planned_addresses`: the executor's options
    of those names."""
    if iters < 1:
        raise XschedError(f"iters must be at least 1, got {iters}", stage="execute")
    sim = simulate(graph, plan, profile, check_budgets=False)
    ex = Executor(
        graph,
        plan,
        devices,
        check=False,
        compile=compile,
        expandable_segments=expandable_segments,
        planned_addresses=planned_addresses,
    )
    try:
        warmed = warm_up(lambda: (ex(env), _sync(ex)), warmup)
        cuda = {d: ex.dev[d] for d in ex.names if ex.dev[d].type == "cuda"}
        for dev in set(cuda.values()):
            torch.cuda.reset_peak_memory_stats(dev)
        energy = _Energy(ex)
        _sync(ex)
        e0 = energy.snapshot() if energy.ok else None
        times, peaks = [], dict.fromkeys(ex.names, 0)
        for _ in range(iters):
            t0 = time.perf_counter()
            st = ex.start(env)
            ex.run(st)
            _sync(ex)
            times.append(time.perf_counter() - t0)
            for d, b in st.peak().items():
                peaks[d] = max(peaks[d], b)
        e1 = energy.snapshot() if energy.ok else None
    finally:
        ex.close()
    source = {d: "executor accounting" for d in ex.names}
    for d, dev in cuda.items():  # shared by the logical devices mapped onto one GPU
        peaks[d] = torch.cuda.max_memory_allocated(dev)
        source[d] = "cuda max_memory_allocated"
    if e0 is not None and e1 is not None:
        joules, how = energy.joules(e0, e1) / iters, energy.source
    elif sim.energy_j is not None and profile is not None:
        sources = "/".join(sorted(set(profile.energy_source.values()))) or "no energy source"
        joules, how = sim.energy_j, f"modelled from the profile ({sources})"
    else:
        joules, how = None, "unavailable"
    return RunReport(
        graph=graph.name,
        method=plan.solver.method,
        iters=iters,
        time_s=statistics.median(times),
        times_s=tuple(times),
        peak_bytes=peaks,
        peak_source=source,
        energy_j=joules,
        energy_source=how,
        predicted_time_s=sim.time_s,
        predicted_makespan_s=sim.makespan_s,
        # compiled regions: their fused allocations as measured on their first run, in place of the per-op counts
        predicted_peak_bytes=compiled_peaks(graph, plan, ex.segments.peaks) if ex.segments else dict(sim.peak_bytes),
        predicted_energy_j=sim.energy_j,
        predicted_from=predicted_from or ("the profile" if profile is not None else "no profile"),
        warmup_iters=warmed,
        spread=relative_spread(times),
    )


SETTLE_WINDOW, SETTLE_SPREAD = 5, 0.05  # the last runs' (q3 - q1) / median under this: the time has settled
WARMUP_MAX_RUNS, WARMUP_MAX_S = 50, 20.0


def warm_up(run: Callable[[], object], fixed: int | None = None, clock: Callable[[], float] = time.perf_counter) -> int:
    """Runs `run` `fixed` times, or until the last SETTLE_WINDOW run times agree within SETTLE_SPREAD (allocator
    caches, lazy initialisation and CPU frequency settle over the first runs), at most WARMUP_MAX_RUNS runs or
    WARMUP_MAX_S seconds; the number of runs made."""
    if fixed is not None:
        for _ in range(fixed):
            run()
        return fixed
    times: list[float] = []
    start = clock()
    while len(times) < WARMUP_MAX_RUNS and clock() - start < WARMUP_MAX_S:
        t0 = clock()
        run()
        times.append(clock() - t0)
        if len(times) >= SETTLE_WINDOW and relative_spread(times[-SETTLE_WINDOW:]) <= SETTLE_SPREAD:
            break
    return len(times)
