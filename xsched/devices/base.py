"""The device plugin protocol, the repeat-until-stable timer, and the registry: the built-in plugins by name, others
through the `xsched.devices` entry points."""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import math
import statistics
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from xsched.contracts.graph import Graph, Op
from xsched.contracts.profile import DeviceInfo
from xsched.errors import ProfileError

ENTRY_POINT_GROUP = "xsched.devices"
ENERGY_SOURCES = ("rapl", "nvml", "model")


class DeviceError(ProfileError):
    """A device name that names no plugin, a plugin that fails to load, or hardware that is not there."""

    def __init__(self, message: str, **where: str | int | None) -> None:
        super().__init__(message, stage=str(where.pop("stage", None) or "devices"), **where)


@dataclass(frozen=True)
class Policy:
    """How hard to measure one op: warm-up calls, then samples until the median is stable or a cap is hit."""

    warmup: int = 2
    min_reps: int = 5
    max_reps: int = 30
    max_time_s: float = 0.25  # per op, device and round, warm-up excluded
    rel_spread: float = 0.05  # stop once (q3 - q1) / median is below this
    min_sample_s: float = 2e-4  # a sample repeats the call until it lasts this long (timer resolution, jitter)

    def quick(self) -> Policy:
        """The policy used once a profiling run has spent its overall time cap."""
        return Policy(warmup=1, min_reps=1, max_reps=3, max_time_s=0.05, rel_spread=1.0, min_sample_s=self.min_sample_s)


DEFAULT_POLICY = Policy()


@dataclass(frozen=True)
class Measurement:
    """What measuring (or modelling) one op on one device gave."""

    time_s: float
    energy_j: float
    energy_source: str  # "rapl" | "nvml" | "model"
    workspace_bytes: int = 0
    reps: int = 0
    spread: float = 0.0  # relative inter-quartile range of the samples
    flops: float | None = None


@dataclass(frozen=True)
class DeviceInfoRow:
    """One line of `available_devices()`: a device name this machine can profile, and what it is."""

    name: str
    kind: str
    description: str
    memory_bytes: int
    details: Mapping[str, Any] = field(default_factory=dict)


class Device(ABC):
    """A place ops can run (or be modelled). Subclasses are found by entry point; the kind is the entry-point name."""

    kind: ClassVar[str] = ""
    simulated: ClassVar[bool] = False  # True: times are computed, nothing runs

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"

    # ---- identity ----
    @property
    @abstractmethod
    def memory_bytes(self) -> int: ...

    @property
    @abstractmethod
    def description(self) -> str: ...

    @abstractmethod
    def fingerprint_parts(self) -> dict[str, str]:
        """What makes measurements on this device comparable: hardware and software identity, no timings."""

    @property
    def fingerprint(self) -> str:
        text = json.dumps(self.fingerprint_parts(), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:24]

    @property
    def is_host(self) -> bool:
        """A CPU (its memory is host memory): copies between two hosts are memcpys, host<->GPU ones PCIe-like."""
        return self.kind == "cpu"

    @property
    def torch_device(self) -> Any:
        """The torch.device ops run on, or None for a simulated device."""
        return None

    @property
    def energy_source(self) -> str:
        """'rapl' / 'nvml' when the hardware counter is readable here, else 'model'."""
        return "model"

    def info(self) -> DeviceInfo:
        extra = {
            "description": self.description,
            "simulated": self.simulated,
            "fingerprint_parts": self.fingerprint_parts(),
        }
        return DeviceInfo(kind=self.kind, fingerprint=self.fingerprint, memory_bytes=self.memory_bytes, extra=extra)

    # ---- costs ----
    @abstractmethod
    def measure_op(self, graph: Graph, op: Op, policy: Policy = DEFAULT_POLICY) -> Measurement:
        """Time (and energy, workspace) of one call of `op`; raise when the op cannot run here."""

    def measure_ops(self, graph: Graph, ops: Sequence[Op], policy: Policy = DEFAULT_POLICY) -> list[Measurement | str]:
        """One round over `ops`: per op its measurement, or why it cannot run here. By default each op on its own;
        a plugin may instead interleave them in the given order, so each call follows a different op as in a step."""
        found: list[Measurement | str] = []
        for op in ops:
            try:
                found.append(self.measure_op(graph, op, policy))
            except Exception as e:  # cannot run on this device: left out (contract 2, docs/ARCHITECTURE.md)
                found.append(f"{type(e).__name__}: {e}")
        return found

    def copy_seconds(self, other: Device, nbytes: int, *, outgoing: bool, pinned: bool = True) -> float | None:
        """Seconds to move `nbytes` from self to other (outgoing) or from other to self; None: this plugin cannot tell."""
        return None

    @classmethod
    def discover(cls) -> list[DeviceInfoRow]:
        """The devices of this kind on this machine."""
        return []


# ---- timing ----
def repeat_until_stable(
    call: Callable[[], Any], policy: Policy, clock: Callable[[Callable[[], Any], int], float]
) -> list[float]:
    """Per-call seconds of each sample; `clock(call, n)` runs `call` n times and returns the seconds it took."""
    for _ in range(policy.warmup):
        clock(call, 1)
    first = clock(call, 1)
    n = max(1, min(10_000, math.ceil(policy.min_sample_s / first))) if first > 0 else 1
    samples = [first] if n == 1 else []
    spent = first
    while len(samples) < policy.max_reps:
        if samples and spent >= policy.max_time_s:  # an op slower than the cap gets fewer samples, never none
            break
        if len(samples) >= policy.min_reps and relative_spread(samples) <= policy.rel_spread:
            break
        t = clock(call, n)
        spent += t
        samples.append(t / n)
    return samples


def perf_clock(call: Callable[[], Any], n: int) -> float:
    start = time.perf_counter()
    for _ in range(n):
        call()
    return time.perf_counter() - start


def relative_spread(samples: Sequence[float]) -> float:
    if len(samples) < 2:
        return math.inf
    q = statistics.quantiles(samples, n=4, method="inclusive")
    med = statistics.median(samples)
    return (q[2] - q[0]) / med if med > 0 else 0.0


def fit_link(sizes: Sequence[int], seconds: Sequence[float]) -> tuple[float, float]:
    """Fit t = latency + n / bandwidth by least squares on relative error (weights 1/t^2), so the small copies
    set the latency and the large ones the bandwidth; returns (latency_s >= 0, bytes_per_s > 0)."""
    k = len(sizes)
    if k != len(seconds) or k < 2:
        raise ValueError("a link fit needs at least two (size, time) points")
    w = [1.0 / max(t, 1e-12) ** 2 for t in seconds]
    sw = sum(w)
    mx = sum(wi * x for wi, x in zip(w, sizes)) / sw
    my = sum(wi * y for wi, y in zip(w, seconds)) / sw
    sxx = sum(wi * (x - mx) ** 2 for wi, x in zip(w, sizes))
    slope = sum(wi * (x - mx) * (y - my) for wi, x, y in zip(w, sizes, seconds)) / sxx if sxx > 0 else 0.0
    if slope <= 0:  # timing noise swamped the size dependence: fall back to the largest transfer's rate
        i = max(range(k), key=lambda j: sizes[j])
        return 0.0, sizes[i] / max(seconds[i], 1e-12)
    latency = my - slope * mx
    if latency < 0:  # refit through the origin: a negative latency is noise, not physics
        slope = sum(wi * x * y for wi, x, y in zip(w, sizes, seconds)) / sum(wi * x * x for wi, x in zip(w, sizes))
        latency = 0.0
    return latency, 1.0 / slope


# ---- registry ----
# The plugins shipped with xsched, registered here by name so that a source checkout on PYTHONPATH (no installed
# distribution, so no entry points) finds them; a third-party plugin comes through the entry-point group, and cannot
# take a built-in kind's name
BUILTIN_PLUGINS = {
    "cpu": "xsched.devices.cpu:CpuDevice",
    "cuda": "xsched.devices.cuda:CudaDevice",
    "sim": "xsched.devices.sim:SimDevice",
    "ort": "xsched.devices.ort:OrtDevice",
}


def _entry_points() -> dict[str, str]:
    """kind -> "module:attribute" of its plugin class: the entry points, then the built-in plugins over them."""
    found = {ep.name: ep.value for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}
    return {**found, **BUILTIN_PLUGINS}


def _load(target: str) -> Any:
    module, _, attr = target.partition(":")
    obj: Any = importlib.import_module(module.strip())
    for part in filter(None, attr.strip().split(".")):
        obj = getattr(obj, part)
    return obj


def installed_kinds() -> list[str]:
    """Device kinds, built in or with an entry point (without importing their plugins)."""
    return sorted(_entry_points())


def plugins() -> dict[str, type[Device]]:
    """Every installed plugin class by kind (loading each; a broken plugin is skipped here, named by get_device)."""
    found = {}
    for kind in _entry_points():
        try:
            found[kind] = plugin(kind)
        except DeviceError:
            continue
    return found


def plugin(kind: str) -> type[Device]:
    """The plugin class of `kind`: a built-in one, or one registered in the `xsched.devices` entry-point group."""
    eps = _entry_points()
    if kind not in eps:
        raise DeviceError(f"unknown device kind {kind!r}; installed kinds: {', '.join(sorted(eps))}", device=kind)
    try:
        cls = _load(eps[kind])
    except Exception as e:  # a third-party plugin may fail in any way on import
        raise DeviceError(f"device plugin {eps[kind]} failed to load: {type(e).__name__}: {e}", device=kind) from e
    if not (isinstance(cls, type) and issubclass(cls, Device)):
        raise DeviceError(f"entry point {eps[kind]} is not a xsched Device subclass", device=kind)
    return cls


def get_device(name: str | Device) -> Device:
    """A device from its name: 'cpu', 'cpu:threads=4', 'cuda:0', 'sim:h100', 'sim:h100#1'."""
    if isinstance(name, Device):
        return name
    if not isinstance(name, str) or not name.strip():
        raise DeviceError(f"a device name must be a non-empty string, got {name!r}")
    name = name.strip()
    return plugin(name.split(":", 1)[0])(name)


def available_devices(include_sim: bool = True) -> list[DeviceInfoRow]:
    """What this machine has (CPU, GPUs), plus the simulated specs when include_sim."""
    rows: list[DeviceInfoRow] = []
    for cls in plugins().values():
        if cls.simulated and not include_sim:
            continue
        rows.extend(cls.discover())
    return rows


def split_device_list(text: str) -> list[str]:
    """'cpu:threads=1,clock=thread,cuda:0,sim:h100' -> ['cpu:threads=1,clock=thread', 'cuda:0', 'sim:h100']:
    a comma-separated part with '=' and no ':' is one more option of the device before it."""
    names: list[str] = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        if names and "=" in part and ":" not in part:
            names[-1] += "," + part
        else:
            names.append(part)
    return names


def parse_options(name: str, allowed: Sequence[str]) -> dict[str, str]:
    """'kind:a=1,b=2' -> {'a': '1', 'b': '2'}; an unknown or malformed option is a DeviceError."""
    _, _, rest = name.partition(":")
    opts: dict[str, str] = {}
    for part in filter(None, rest.split(",")):
        key, eq, val = part.partition("=")
        if not eq or key not in allowed:
            raise DeviceError(
                f"bad device option {part!r}; options are {', '.join(f'{a}=...' for a in allowed)}", device=name
            )
        opts[key] = val
    return opts
