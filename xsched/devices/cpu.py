"""The CPU device: ops timed with perf_counter at a chosen thread count, energy from RAPL or the power model."""

from __future__ import annotations

import contextlib
import functools
import os
import platform
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

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
from xsched.graph import Graph, Op

# Used when no devices/*.toml spec matches this CPU's model: a mid-range server socket. Labelled "model".
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


class CpuDevice(Device):
    """'cpu' (torch's default thread count) or 'cpu:threads=4' (fewer threads emulate a weaker CPU, as XEngine did).

    'cpu:threads=1,clock=thread' times ops by the measuring thread's CPU time instead of the wall clock: what an
    op costs on a core of its own, unaffected by other jobs sharing the cores (one thread only: with more, the
    CPU time of the others is not this thread's).
    """

    kind = "cpu"

    def __init__(self, name: str) -> None:
        super().__init__(name)
        opts = parse_options(name, ["threads", "clock"])
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
        from xsched.devices.sim import match_spec

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
        from xsched import ops

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
