"""The CPU device: ops timed with perf_counter at a chosen thread count, energy from RAPL or the power model."""

from __future__ import annotations

import contextlib
import functools
import os
import platform
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from xsched.contracts.graph import Graph, Op
from xsched.devices.base import (
    DEFAULT_POLICY,
    Device,
    DeviceError,
    DeviceInfoRow,
    Measurement,
    Policy,
    parse_options,
    perf_clock,
    relative_spread,
    repeat_until_stable,
)
from xsched.devices.energy import modelled_energy, rapl

SWEEP_BYTES = 2 << 30  # at most about this much input/output memory per interleaved sweep (measure_ops)
# Used when no xsched/devices/specs/*.toml spec matches this CPU's model: a mid-range server socket. Labelled "model".
DEFAULT_POWER = {"idle_power_w": 10.0, "max_power_w": 65.0}


@functools.cache
def cpu_model() -> dict[str, Any]:
    """Brand, architecture and logical core count (py-cpuinfo, which takes ~1 s: cached)."""
    try:
        import cpuinfo

        info = cpuinfo.get_cpu_info()
        return {
            "brand": str(info.get("brand_raw") or platform.processor()),
            "arch": str(info.get("arch", platform.machine())),
            "logical_cores": int(info.get("count") or os.cpu_count() or 1),
            "flags": sorted(info.get("flags", [])),
        }
    except Exception:  # py-cpuinfo missing or failing on an exotic platform
        return {
            "brand": platform.processor() or "unknown",
            "arch": platform.machine(),
            "logical_cores": os.cpu_count() or 1,
            "flags": [],
        }


def host_memory_bytes() -> int:
    """Physical memory, or the cgroup limit when one is set and smaller."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for limit_file in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        with contextlib.suppress(OSError, ValueError):
            total = min(total, int(Path(limit_file).read_text().strip()))
    return total


def thread_clock(call: Callable[[], Any], n: int) -> float:
    """CPU seconds this thread spent on n calls (time slices given to other processes do not count)."""
    start = time.thread_time()
    for _ in range(n):
        call()
    return time.thread_time() - start


@contextlib.contextmanager
def torch_threads(n: int | None) -> Iterator[None]:
    """Run the body with torch using `n` intra-op threads, then restore the previous count."""
    before = torch.get_num_threads()
    if n is not None and n != before:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)


def _enough(samples: Sequence[float], policy: Policy) -> bool:
    """An op in a sweep stops being timed at max_reps, past its time cap, or once its median is stable."""
    if len(samples) >= policy.max_reps or sum(samples) >= policy.max_time_s:
        return True
    return len(samples) >= policy.min_reps and relative_spread(samples) <= policy.rel_spread


class CpuDevice(Device):
    """'cpu' (torch's default thread count) or 'cpu:threads=4' (fewer threads emulate a weaker CPU, as XEngine did).

    'cpu:threads=1,clock=thread' times ops by the measuring thread's CPU time instead of the wall clock: what an
    op costs on a core of its own, unaffected by other jobs sharing the cores (one thread only: with more, the
    CPU time of the others is not this thread's).
    """

    kind = "cpu"

    def __init__(self, name: str) -> None:
        super().__init__(name)
        # "cpu:1" or "cpu:1,threads=2": a logical CPU device (plans on cpu:0 and cpu:1 keep separate stores), the
        # same hardware measured under its own name
        _, _, rest = name.partition(":")
        first, _, more = rest.partition(",")
        self.index = int(first) if first.isdigit() else None
        opts = parse_options(f"cpu:{more}" if self.index is not None else name, ["threads", "clock"])
        self.threads: int | None = None
        if "threads" in opts:
            if not opts["threads"].isdigit() or int(opts["threads"]) < 1:
                raise DeviceError(f"threads must be a positive integer, got {opts['threads']!r}", device=name)
            self.threads = int(opts["threads"])
        self.clock = opts.get("clock", "wall")
        if self.clock not in ("wall", "thread"):
            raise DeviceError(f"clock must be wall or thread, got {self.clock!r}", device=name)
        if self.clock == "thread" and self.threads != 1:
            raise DeviceError("clock=thread measures one thread's CPU time: it needs threads=1", device=name)
        from xsched.devices.spec import match_spec

        self.spec = match_spec(cpu_model()["brand"], "cpu")

    @property
    def effective_threads(self) -> int:
        return self.threads or torch.get_num_threads()

    @property
    def memory_bytes(self) -> int:
        return host_memory_bytes()

    @property
    def description(self) -> str:
        m = cpu_model()
        return f"{m['brand']} ({m['logical_cores']} logical cores, {self.effective_threads} threads)"

    def fingerprint_parts(self) -> dict[str, str]:
        m = cpu_model()
        return {
            "brand": m["brand"],
            "arch": m["arch"],
            "logical_cores": str(m["logical_cores"]),
            "threads": str(self.effective_threads),
            "clock": self.clock,
            "torch": torch.__version__,
            "memory_gib": str(round(self.memory_bytes / 2**30)),
        }

    @property
    def torch_device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def energy_source(self) -> str:
        return "rapl" if rapl().available else "model"

    @property
    def power(self) -> dict[str, float]:
        return self.spec.power if self.spec is not None else DEFAULT_POWER

    def measure_op(self, graph: Graph, op: Op, policy: Policy = DEFAULT_POLICY) -> Measurement:
        from xsched.contracts import torch_ops as ops

        env = ops.op_input_tensors(graph, op, "cpu", torch.Generator().manual_seed(0))
        calls = 0

        def call() -> None:
            nonlocal calls
            calls += 1
            ops.run_op(op, env, "cpu")

        with torch_threads(self.threads), torch.no_grad():
            meter = rapl()
            call()  # a first call outside the energy window: allocator and kernel selection warm up
            before, calls = (meter.snapshot() if meter.available else None), 0
            samples = repeat_until_stable(call, policy, thread_clock if self.clock == "thread" else perf_clock)
            after = meter.snapshot() if meter.available else None
        t = statistics.median(samples)
        if before is not None and after is not None and calls:
            energy, source = meter.joules(before, after) / calls, "rapl"
        else:
            utilisation = self.effective_threads / max(cpu_model()["logical_cores"], 1)
            energy, source = modelled_energy(t, self.power, utilisation), "model"
        # Workspace on CPU is not measurable honestly (no per-op peak in the CPU allocator): recorded as 0.
        return Measurement(t, energy, source, 0, len(samples), relative_spread(samples) if len(samples) > 1 else 0.0)

    def measure_ops(self, graph: Graph, ops: Sequence[Op], policy: Policy = DEFAULT_POLICY) -> list[Measurement | str]:
        """Time the ops interleaved: sweeps call each once in the given (graph) order, each call timed on its own.

        An op called over and over on the same inputs runs faster than in a step, by ~10% (matmuls) to 3x (small
        elementwise ops): its inputs, output block and code stay hot (docs/bench/profile.md). In a sweep each call
        follows a different op, as in a step. A call is long enough for the ns clocks, so min_sample_s does not apply."""
        found: list[Measurement | str] = ["not measured"] * len(ops)
        window: list[int] = []
        held = 0
        for i, op in enumerate(ops):  # windows bound the memory held by all the ops' inputs at once
            window.append(i)
            held += graph.op_bytes(op.id)
            if held >= SWEEP_BYTES or i == len(ops) - 1:
                found_w = self._sweep(graph, [ops[j] for j in window], policy)
                for j, m in zip(window, found_w, strict=True):
                    found[j] = m
                window, held = [], 0
        return found

    def _sweep(self, graph: Graph, ops: Sequence[Op], policy: Policy) -> list[Measurement | str]:
        """One window of measure_ops: inputs for all its ops, warm-up sweeps, then timed sweeps until each is done."""
        from xsched.contracts import torch_ops as xops

        found: list[Measurement | str] = ["not measured"] * len(ops)
        calls: dict[int, Callable[[], Any]] = {}
        with torch_threads(self.threads), torch.no_grad():
            for i, op in enumerate(ops):
                try:
                    env = xops.op_input_tensors(graph, op, "cpu", torch.Generator().manual_seed(0))
                    xops.run_op(op, env, "cpu")  # allocator and kernel selection warm up; an op that fails is out
                    calls[i] = functools.partial(xops.run_op, op, env, "cpu")
                except Exception as e:  # cannot run here: left out (contract 2, docs/ARCHITECTURE.md)
                    found[i] = f"{type(e).__name__}: {e}"
            for _ in range(policy.warmup):
                for call in calls.values():
                    call()
            clock = time.thread_time if self.clock == "thread" else time.perf_counter
            samples: dict[int, list[float]] = {i: [] for i in calls}
            live = list(calls)
            meter = rapl()
            before = meter.snapshot() if meter.available else None
            while live:
                for i in live:
                    t0 = clock()
                    calls[i]()
                    samples[i].append(clock() - t0)
                live = [i for i in live if not _enough(samples[i], policy)]
            after = meter.snapshot() if meter.available else None
        timed = sum(sum(s) for s in samples.values())
        for i, s in samples.items():
            t = statistics.median(s)
            if before is not None and after is not None and timed > 0:  # the sweeps' energy, shared by time
                energy, source = meter.joules(before, after) * sum(s) / timed / len(s), "rapl"
            else:
                utilisation = self.effective_threads / max(cpu_model()["logical_cores"], 1)
                energy, source = modelled_energy(t, self.power, utilisation), "model"
            found[i] = Measurement(t, energy, source, 0, len(s), relative_spread(s) if len(s) > 1 else 0.0)
        return found

    def copy_seconds(self, other: Device, nbytes: int, *, outgoing: bool, pinned: bool = True) -> float | None:
        if other.kind != "cpu" or other.simulated:
            return None
        # Two logical CPU devices share memory; a plan's copy between them is a clone. Time a memcpy of nbytes.
        src = torch.empty(max(nbytes, 1), dtype=torch.uint8)
        dst = torch.empty_like(src)
        policy = Policy(warmup=1, min_reps=5, max_reps=20, max_time_s=0.2)
        with torch_threads(self.threads):
            clock = thread_clock if self.clock == "thread" else perf_clock
            samples = repeat_until_stable(lambda: dst.copy_(src), policy, clock)
        return statistics.median(samples)

    @classmethod
    def discover(cls) -> list[DeviceInfoRow]:
        m = cpu_model()
        dev = cls("cpu")
        details = {
            "arch": m["arch"],
            "logical_cores": m["logical_cores"],
            "torch_threads": torch.get_num_threads(),
            "energy": dev.energy_source,
            "spec": dev.spec.name if dev.spec else None,
        }
        return [DeviceInfoRow("cpu", "cpu", m["brand"], dev.memory_bytes, details)]
