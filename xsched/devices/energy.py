"""Energy counters: RAPL through powercap on CPUs, NVML's total-energy counter on NVIDIA GPUs, and the power model."""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

POWERCAP = Path("/sys/class/powercap")
_PACKAGE = re.compile(r"^intel-rapl:\d+$")  # package domains; their subdomains (intel-rapl:0:0) are inside them


class RaplReader:
    """Package energy from powercap RAPL, summed over sockets, with wrap-around of each 32/64-bit counter."""

    def __init__(self, root: Path | str = POWERCAP) -> None:
        self.root = Path(root)
        self.domains: list[tuple[Path, int]] = []  # (energy_uj file, max_energy_range_uj)
        if not self.root.is_dir():
            return
        for d in sorted(self.root.iterdir()):
            if not _PACKAGE.match(d.name):
                continue
            try:
                max_range = int((d / "max_energy_range_uj").read_text())
                int((d / "energy_uj").read_text())  # readable? (root-only on many kernels since 2020)
            except (OSError, ValueError):
                continue
            self.domains.append((d / "energy_uj", max_range))

    @property
    def available(self) -> bool:
        return bool(self.domains)

    def snapshot(self) -> tuple[int, ...]:
        """Raw counters (microjoules) of every package domain."""
        return tuple(int(f.read_text()) for f, _ in self.domains)

    def joules(self, before: tuple[int, ...], after: tuple[int, ...]) -> float:
        """Energy between two snapshots, assuming each counter wrapped at most once in between."""
        total = 0
        for (_, max_range), a, b in zip(self.domains, before, after):
            total += b - a if b >= a else b + max_range - a
        return total / 1e6


@functools.cache
def rapl() -> RaplReader:
    return RaplReader()


# ---- NVML ----
@functools.cache
def nvml() -> Any:
    """The initialised pynvml module, or None when nvidia-ml-py or the driver is missing."""
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml
    except Exception:  # ImportError, NVMLError_LibraryNotFound, driver not loaded, ...
        return None


def nvml_handle(index: int, pci_bus_id: str | None = None) -> Any:
    """The NVML handle of a GPU (by PCI bus id when given: CUDA and NVML may number GPUs differently)."""
    nv = nvml()
    if nv is None:
        return None
    try:
        if pci_bus_id:
            return nv.nvmlDeviceGetHandleByPciBusId(pci_bus_id)
        return nv.nvmlDeviceGetHandleByIndex(index)
    except Exception:
        return None


def nvml_energy_mj(handle: Any) -> int | None:
    """Total energy since driver load in millijoules (Volta and newer), or None when not supported."""
    nv = nvml()
    if nv is None or handle is None:
        return None
    try:
        return int(nv.nvmlDeviceGetTotalEnergyConsumption(handle))
    except Exception:
        return None


def nvml_gpus() -> list[dict[str, Any]]:
    """Name, memory, driver and power limit of every GPU NVML sees ([] without NVML)."""
    nv = nvml()
    if nv is None:
        return []
    try:
        driver = _text(nv.nvmlSystemGetDriverVersion())
        count = nv.nvmlDeviceGetCount()
    except Exception:
        return []
    rows = []
    for i in range(count):
        h = nv.nvmlDeviceGetHandleByIndex(i)
        row: dict[str, Any] = {"index": i, "name": _text(nv.nvmlDeviceGetName(h)), "driver": driver}
        row["memory_bytes"] = int(nv.nvmlDeviceGetMemoryInfo(h).total)
        row["power_limit_w"] = _try(lambda h=h: nv.nvmlDeviceGetEnforcedPowerLimit(h) / 1000.0)
        row["pci_bus_id"] = _try(lambda h=h: _text(nv.nvmlDeviceGetPciInfo(h).busId))
        row["energy_counter"] = nvml_energy_mj(h) is not None
        rows.append(row)
    return rows


def _text(x: Any) -> str:
    return x.decode() if isinstance(x, bytes) else str(x)


def _try(f: Any) -> Any:
    try:
        return f()
    except Exception:
        return None


# ---- the power model ----
def modelled_energy(time_s: float, power: Mapping[str, float], utilisation: float = 1.0) -> float:
    """(idle + (max - idle) * utilisation) * time: a device that is busy for `time_s` at that utilisation."""
    u = min(max(utilisation, 0.0), 1.0)
    idle, peak = float(power["idle_power_w"]), float(power["max_power_w"])
    return (idle + (peak - idle) * u) * time_s
