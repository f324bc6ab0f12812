"""What a training step is shown with beside its loss: per-device peak memory (measured on CUDA, the plan's
prediction elsewhere) and energy (measured by NVML / RAPL where readable, else modelled from the profile), each
labelled with where it comes from."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from xsched.contracts.plan import Plan
from xsched.contracts.profile import Profile
from xsched.devices.energy import nvml_energy_mj, nvml_handle, rapl


class PeakMeter:
    """Peak bytes per plan device over one step: CUDA's max_memory_allocated on GPUs (everything the process
    holds there: params, optimizer state, the plan's tensors), the plan's predicted peak on the others."""

    def __init__(self, plan: Plan, torch_devices: Mapping[str, torch.device]) -> None:
        predicted = plan.predicted.peak_bytes if plan.predicted is not None else {}
        self.devices = dict(torch_devices)
        self.cuda = sorted({d for d in self.devices.values() if d.type == "cuda"}, key=str)
        self.predicted = {d: int(predicted.get(d, 0)) for d in self.devices}
        self.source = {d: "measured" if t.type == "cuda" else "plan" for d, t in self.devices.items()}

    def start(self) -> None:
        for dev in self.cuda:
            torch.cuda.reset_peak_memory_stats(dev)

    def read(self) -> dict[str, int]:
        return {
            d: torch.cuda.max_memory_allocated(t) if t.type == "cuda" else self.predicted[d]
            for d, t in self.devices.items()
        }

    def sync(self) -> None:
        for dev in self.cuda:
            torch.cuda.synchronize(dev)


class EnergyMeter:
    """Energy of one step: the hardware counters of the devices the plan uses when all are readable (NVML on the
    GPUs, RAPL on the CPU package; whole-device energy, other processes included), else the plan's modelled energy
    per iteration (the profile's per-op energies: measured or power-model, as the profile says)."""

    def __init__(self, plan: Plan, profile: Profile, torch_devices: Mapping[str, torch.device]) -> None:
        kinds = {t.type for t in torch_devices.values()}
        gpus = sorted({t.index or 0 for t in torch_devices.values() if t.type == "cuda"})
        self.gpus = [nvml_handle(i) for i in gpus]
        self.rapl = rapl() if "cpu" in kinds else None
        self.measured = all(h is not None and nvml_energy_mj(h) is not None for h in self.gpus) and (
            self.rapl is None or self.rapl.available
        )
        self.modelled = plan.predicted.energy_j if plan.predicted is not None else None
        if self.measured:
            self.source = "measured (" + "+".join(["nvml"] * bool(self.gpus) + ["rapl"] * bool(self.rapl)) + ")"
        elif profile.modelled:  # bandwidth-modelled costs carry no energy
            self.source, self.modelled = "unavailable (modelled costs have no energy; --profile measure has)", None
        else:
            sources = "/".join(sorted(set(profile.energy_source.values()))) or "none"
            self.source = f"modelled (profile energy: {sources})"
        self._before: tuple = ()

    def _snapshot(self) -> tuple:
        return tuple(nvml_energy_mj(h) for h in self.gpus), self.rapl.snapshot() if self.rapl else ()

    def start(self) -> None:
        if self.measured:
            self._before = self._snapshot()

    def read(self) -> float | None:
        """Joules since `start()` (measured), or the plan's modelled energy of one iteration."""
        if not self.measured:
            return self.modelled
        after = self._snapshot()
        gpu = sum((b - a) / 1e3 for a, b in zip(self._before[0], after[0]))
        return gpu + (self.rapl.joules(self._before[1], after[1]) if self.rapl else 0.0)
