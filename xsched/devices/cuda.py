"""The CUDA device: ops timed with CUDA events, workspace from the caching allocator, energy from NVML's counter."""

from __future__ import annotations

import math
import os
import statistics
import time
from collections.abc import Callable
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
    relative_spread,
    repeat_until_stable,
)
from xsched.devices.energy import modelled_energy, nvml_energy_mj, nvml_gpus, nvml_handle

ENERGY_WINDOW_S = 0.2  # NVML's counter is in mJ but refreshes every few ms: measure over at least this long
MAX_ENERGY_CALLS = 100_000


def event_clock(call: Callable[[], Any], n: int) -> float:
    """Seconds for n calls on the current stream, between two CUDA events (no host-side launch gaps)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        call()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def sync_clock(*devices: torch.device) -> Callable[[Callable[[], Any], int], float]:
    """Wall seconds for n calls with every device synchronised around them (blocking or cross-device copies)."""

    def clock(call: Callable[[], Any], n: int) -> float:
        for d in devices:
            torch.cuda.synchronize(d)
        t0 = time.perf_counter()
        for _ in range(n):
            call()
        for d in devices:
            torch.cuda.synchronize(d)
        return time.perf_counter() - t0

    return clock


def _bus_id(props: Any) -> str | None:
    """NVML's form of the PCI bus id, so NVML and CUDA agree on which GPU this is whatever CUDA_VISIBLE_DEVICES says."""
    if not all(hasattr(props, a) for a in ("pci_domain_id", "pci_bus_id", "pci_device_id")):
        return None
    return f"{props.pci_domain_id:08X}:{props.pci_bus_id:02X}:{props.pci_device_id:02X}.0"


class CudaDevice(Device):
    """'cuda' or 'cuda:N': an NVIDIA GPU through torch.cuda."""

    kind = "cuda"

    def __init__(self, name: str) -> None:
        super().__init__(name)
        _, _, idx = name.partition(":")
        if idx and not idx.isdigit():
            raise DeviceError(f"a CUDA device is cuda or cuda:<index>, got {name!r}", device=name)
        self.index = int(idx or 0)
        if not torch.cuda.is_available():
            raise DeviceError(
                f"CUDA is not available here (torch {torch.__version__}, built for CUDA {torch.version.cuda})",
                device=name,
            )
        if self.index >= torch.cuda.device_count():
            raise DeviceError(f"no GPU {self.index}: this machine has {torch.cuda.device_count()}", device=name)
        self.props = torch.cuda.get_device_properties(self.index)
        bus = _bus_id(self.props)
        # without a bus id, NVML's index is CUDA's only when CUDA_VISIBLE_DEVICES does not renumber the GPUs;
        # rather no counter (energy modelled, and labelled so) than another GPU's counter
        remapped = bus is None and os.environ.get("CUDA_VISIBLE_DEVICES") not in (None, "")
        self.nvml = None if remapped else nvml_handle(self.index, bus)
        from xsched.devices.spec import match_spec

        self.spec = match_spec(self.props.name, "gpu")

    @property
    def torch_device(self) -> torch.device:
        return torch.device("cuda", self.index)

    @property
    def memory_bytes(self) -> int:
        return int(self.props.total_memory)

    @property
    def description(self) -> str:
        return f"{self.props.name} ({self.memory_bytes / 2**30:.0f} GiB)"

    def fingerprint_parts(self) -> dict[str, str]:
        gpu = next((g for g in nvml_gpus() if g.get("pci_bus_id") and g["pci_bus_id"] == _bus_id(self.props)), {})
        return {
            "name": self.props.name,
            "memory_bytes": str(self.memory_bytes),
            "capability": f"{self.props.major}.{self.props.minor}",
            "sms": str(self.props.multi_processor_count),
            "driver": str(gpu.get("driver", "unknown")),
            "cuda": str(torch.version.cuda),
            "cudnn": str(torch.backends.cudnn.version()),
            "torch": torch.__version__,
        }

    @property
    def energy_source(self) -> str:
        return "nvml" if nvml_energy_mj(self.nvml) is not None else "model"

    @property
    def power(self) -> dict[str, float]:
        if self.spec is not None:
            return self.spec.power
        limit = next((g["power_limit_w"] for g in nvml_gpus() if g.get("power_limit_w")), None) or 300.0
        return {"idle_power_w": 0.1 * limit, "max_power_w": limit}  # no spec for this GPU: a guess, labelled "model"

    def measure_op(self, graph: Graph, op: Op, policy: Policy = DEFAULT_POLICY) -> Measurement:
        from xsched.contracts import torch_ops as ops

        dev = self.torch_device
        with torch.cuda.device(dev), torch.no_grad():
            # drawn on the GPU (made on the host, logits-sized inputs took seconds per op and round) and reused by
            # every call below: warm-up, samples, workspace and energy window
            env = ops.op_input_tensors(graph, op, dev, torch.Generator(device=dev).manual_seed(0))
            workspace = self._workspace(op, env)
            samples = repeat_until_stable(lambda: ops.run_op(op, env, dev), policy, event_clock)
            t = statistics.median(samples)
            energy = self._nvml_energy(lambda: ops.run_op(op, env, dev), t, min(ENERGY_WINDOW_S, policy.max_time_s))
        source = "nvml"
        if energy is None:
            energy, source = modelled_energy(t, self.power, 1.0), "model"
        return Measurement(
            t, energy, source, workspace, len(samples), relative_spread(samples) if len(samples) > 1 else 0.0
        )

    def _workspace(self, op: Op, env: dict[str, torch.Tensor]) -> int:
        """Bytes the op allocates beyond its outputs: the allocator's peak during one call, less the outputs."""
        from xsched.contracts import torch_ops as ops

        dev = self.torch_device
        ops.run_op(op, env, dev)  # first call: cuDNN/cuBLAS handles and autotuning allocate once, not per call
        torch.cuda.synchronize(dev)
        base = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        outs = ops.run_op(op, env, dev)
        torch.cuda.synchronize(dev)
        peak = torch.cuda.max_memory_allocated(dev)
        inputs = {t.untyped_storage().data_ptr() for t in env.values()}
        storages = {
            o.untyped_storage().data_ptr(): o.untyped_storage().nbytes() for o in outs if isinstance(o, torch.Tensor)
        }
        # outputs that alias an input cost nothing; the allocator rounds every block up to 512 bytes
        out_bytes = sum(-(-n // 512) * 512 for p, n in storages.items() if p not in inputs)
        del outs
        return max(0, peak - base - out_bytes)

    def _nvml_energy(self, call: Callable[[], Any], t: float, window_s: float) -> float | None:
        """Joules per call from NVML's total-energy counter over enough calls to fill `window_s`: the policy's time
        per op at most, so that profiling's time cap (the quick policy) bounds the energy windows too."""
        if nvml_energy_mj(self.nvml) is None:
            return None
        n = max(1, min(MAX_ENERGY_CALLS, math.ceil(window_s / max(t, 1e-7))))
        torch.cuda.synchronize(self.torch_device)
        e0 = nvml_energy_mj(self.nvml)
        for _ in range(n):
            call()
        torch.cuda.synchronize(self.torch_device)
        e1 = nvml_energy_mj(self.nvml)
        if e0 is None or e1 is None or e1 <= e0:  # the counter did not move: too coarse to say anything
            return None
        return (e1 - e0) / 1e3 / n

    def copy_seconds(self, other: Device, nbytes: int, *, outgoing: bool, pinned: bool = True) -> float | None:
        dev = self.torch_device
        policy = Policy(warmup=2, min_reps=5, max_reps=30, max_time_s=0.3)
        n = max(nbytes, 1)
        gpu = torch.empty(n, dtype=torch.uint8, device=dev)
        if other.is_host:  # a real or simulated CPU: the host side is this machine's memory
            host = torch.empty(n, dtype=torch.uint8, pin_memory=pinned)
            dst, src = (host, gpu) if outgoing else (gpu, host)
            clock = event_clock if pinned else sync_clock(dev)  # a pageable copy blocks the host: time it on the host
            with torch.cuda.device(dev):
                samples = repeat_until_stable(lambda: dst.copy_(src, non_blocking=pinned), policy, clock)
            return statistics.median(samples)
        if isinstance(other, CudaDevice):
            peer = torch.empty(n, dtype=torch.uint8, device=other.torch_device)
            dst, src = (peer, gpu) if outgoing else (gpu, peer)
            samples = repeat_until_stable(lambda: dst.copy_(src), policy, sync_clock(dev, other.torch_device))
            return statistics.median(samples)
        return None

    @classmethod
    def discover(cls) -> list[DeviceInfoRow]:
        gpus = nvml_gpus()
        if not torch.cuda.is_available():
            # NVML sees GPUs this torch build cannot use (CPU-only wheel): list them, unusable
            return [
                DeviceInfoRow(
                    f"cuda:{g['index']}", "cuda", f"{g['name']} (not usable: torch has no CUDA)", g["memory_bytes"], g
                )
                for g in gpus
            ]
        rows = []
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            g = next((g for g in gpus if g.get("pci_bus_id") == _bus_id(props)), None) or {}
            details = {
                "capability": f"{props.major}.{props.minor}",
                "driver": g.get("driver"),
                "power_limit_w": g.get("power_limit_w"),
                "energy_counter": g.get("energy_counter", False),
            }
            rows.append(DeviceInfoRow(f"cuda:{i}", "cuda", props.name, int(props.total_memory), details))
        return rows
