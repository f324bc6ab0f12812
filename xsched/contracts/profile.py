"""The profile (contract 2, docs/ARCHITECTURE.md): per-device op costs and per-pair copy costs, with JSON load/save
(always validated)."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from functools import cached_property
from pathlib import Path
from typing import Any

from xsched.contracts.graph import read_text
from xsched.errors import ProfileError

SCHEMA = "xsched.profile/1"


@dataclass(frozen=True)
class OpCost:
    """Cost of one op on one device."""

    time_s: float
    energy_j: float = 0.0
    workspace_bytes: int = 0


@dataclass(frozen=True)
class LinkCost:
    """Cost of copying between an ordered pair of devices: latency + nbytes / bandwidth."""

    latency_s: float
    bytes_per_s: float
    per_value: Mapping[str, float] = field(default_factory=dict)
    energy_j_per_byte: float = 0.0


@dataclass(frozen=True)
class DeviceInfo:
    """What the profile knows of a device."""

    kind: str
    fingerprint: str = ""
    memory_bytes: int = 0
    extra: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class BackToBack:
    """How one device runs a step's ops back to back, measured once: the eager step (every op in graph order,
    as the executor's one-device program runs it) against the sum of the ops' profiled times, each timed alone.
    Model: an op timed alone costs its kernel plus a launch overhead; back to back the next launch hides behind
    the running kernel, so only the longer of the two is paid (never more than the op alone). A negative overhead
    is a cost each op pays in a step and not alone (on a CPU: the executor's dispatch, allocations not reused)."""

    step_s: float  # the measured back-to-back eager step
    alone_s: float  # the sum of its ops' profiled (alone) times
    overhead_s: float  # the per-op overhead fitted so that the model's step is step_s (0: the times alone)

    def time(self, alone_s: float) -> float:
        """Seconds an op profiled at `alone_s` takes within a step run back to back."""
        return max(alone_s - self.overhead_s, min(alone_s, self.overhead_s))


@dataclass(frozen=True)
class Profile:
    """Costs for one graph (by fingerprint) on a set of devices."""

    graph: str
    devices: Mapping[str, DeviceInfo]
    compute: Mapping[str, Mapping[str, OpCost]]  # device -> op id -> cost
    copy: Mapping[str, LinkCost] = field(default_factory=dict)  # "src->dst" -> cost
    energy_source: Mapping[str, str] = field(default_factory=dict)
    extra: Mapping[str, Any] = field(default_factory=dict)
    # ---- how the costs were made (top-level JSON keys, as files before these were fields had them)
    stores: tuple[str, ...] = ()  # devices profiled as stores: their copies only, no op (no compute entries)
    modelled: bool = False  # every cost from the roofline model (profiling/model.py), none measured
    profiling: Mapping[str, Any] | None = None  # a measured profile's run: created, wall_s, policy, ops, ...
    # device -> how it runs ops back to back; absent (old files, models, tests): each op costs its time alone
    back_to_back: Mapping[str, BackToBack] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _check_roles(self)

    def op_cost(self, op: str, device: str) -> OpCost | None:
        """The cost of `op` on `device` within a step, or None when the op cannot run there: its profiled time,
        calibrated by the device's back_to_back model where it has one (compute holds the times alone)."""
        if device in self.back_to_back:
            return self._calibrated[device].get(op)
        return self.compute.get(device, {}).get(op)

    @cached_property
    def _calibrated(self) -> dict[str, dict[str, OpCost]]:
        """The calibrated devices' costs, made once: solvers ask for op costs in their inner loops."""
        return {
            d: {o: replace(c, time_s=b.time(c.time_s)) for o, c in self.compute.get(d, {}).items()}
            for d, b in self.back_to_back.items()
        }

    def can_run(self, op: str, device: str) -> bool:
        return op in self.compute.get(device, {})

    def is_store(self, device: str) -> bool:
        """A device of this profile that runs no op (no compute entries): it only holds values, linked by copies."""
        return device in self.devices and not self.compute.get(device)

    def link(self, src: str, dst: str) -> LinkCost | None:
        return self.copy.get(f"{src}->{dst}")

    def copy_time(self, value: str, nbytes: int, src: str, dst: str) -> float | None:
        """Seconds to copy `value` from src to dst, or None when the pair has no link."""
        link = self.link(src, dst)
        if link is None:
            return None
        if value in link.per_value:
            return link.per_value[value]
        return link.latency_s + (nbytes / link.bytes_per_s if link.bytes_per_s > 0 else 0.0)

    def copy_energy(self, nbytes: int, src: str, dst: str) -> float:
        link = self.link(src, dst)
        return link.energy_j_per_byte * nbytes if link is not None else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "graph": self.graph,
            "devices": {
                d: {"kind": i.kind, "fingerprint": i.fingerprint, "memory_bytes": i.memory_bytes, **dict(i.extra)}
                for d, i in self.devices.items()
            },
            "compute": {
                d: {
                    o: {"time_s": c.time_s, "energy_j": c.energy_j, "workspace_bytes": c.workspace_bytes}
                    for o, c in ops.items()
                }
                for d, ops in self.compute.items()
            },
            "copy": {
                k: {
                    "latency_s": c.latency_s,
                    "bytes_per_s": c.bytes_per_s,
                    "per_value": dict(c.per_value),
                    **({"energy_j_per_byte": c.energy_j_per_byte} if c.energy_j_per_byte else {}),
                }
                for k, c in self.copy.items()
            },
            "energy_source": dict(self.energy_source),
            **({"stores": list(self.stores)} if self.stores else {}),
            **({"modelled": True} if self.modelled else {}),
            **({"profiling": dict(self.profiling)} if self.profiling is not None else {}),
            **({"back_to_back": {d: asdict(b) for d, b in self.back_to_back.items()}} if self.back_to_back else {}),
            **dict(self.extra),
        }

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> Profile:
        if not isinstance(d, Mapping) or d.get("schema") != SCHEMA:
            got = d.get("schema") if isinstance(d, Mapping) else type(d).__name__
            raise ProfileError(f"unknown profile schema {got!r}, expected {SCHEMA!r}")
        try:
            devices = {}
            for name, info in d["devices"].items():
                info = dict(info)
                devices[name] = DeviceInfo(
                    kind=str(info.pop("kind")),
                    fingerprint=str(info.pop("fingerprint", "")),
                    memory_bytes=int(info.pop("memory_bytes", 0)),
                    extra=info,
                )
            compute = {
                dev: {
                    op: OpCost(float(c["time_s"]), float(c.get("energy_j") or 0.0), int(c.get("workspace_bytes", 0)))
                    for op, c in ops.items()
                }
                for dev, ops in d["compute"].items()
            }
            copy = {
                k: LinkCost(
                    float(c["latency_s"]),
                    float(c["bytes_per_s"]),
                    {v: float(t) for v, t in c.get("per_value", {}).items()},
                    float(c.get("energy_j_per_byte", 0.0)),
                )
                for k, c in d.get("copy", {}).items()
            }
            known = {
                "schema",
                "graph",
                "devices",
                "compute",
                "copy",
                "energy_source",
                "stores",
                "modelled",
                "profiling",
                "back_to_back",
            }
            stores, profiling = d.get("stores", ()), d.get("profiling")
            return Profile(
                graph=str(d["graph"]),
                devices=devices,
                compute=compute,
                copy=copy,
                energy_source=dict(d.get("energy_source", {})),
                extra={k: v for k, v in d.items() if k not in known},
                stores=tuple(stores) if isinstance(stores, list) else stores,
                modelled=d.get("modelled", False),
                profiling=dict(profiling) if isinstance(profiling, Mapping) else profiling,
                back_to_back=_read_back_to_back(d.get("back_to_back", {})),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ProfileError(f"malformed profile JSON: {type(e).__name__}: {e}") from e

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")

    @staticmethod
    def load(path: str | Path) -> Profile:
        try:
            d = json.loads(read_text(path))
        except (OSError, json.JSONDecodeError, UnicodeDecodeError, EOFError) as e:
            raise ProfileError(f"cannot read profile file {path}: corrupt or unreadable ({e})") from e
        profile = Profile.from_dict(d)
        validate_profile(profile, str(path))
        return profile

    def check_graph(self, graph_fingerprint: str) -> None:
        """Raise unless this profile was made for the graph with that fingerprint."""
        if self.graph != graph_fingerprint:
            raise ProfileError(
                f"profile is for graph {self.graph}, not {graph_fingerprint}: re-profile this graph (--reprofile)"
            )


def _read_back_to_back(raw: Any) -> dict[str, BackToBack]:
    """The JSON object of back_to_back: device -> {step_s, alone_s, overhead_s}, numbers checked by _check_roles."""
    if not isinstance(raw, Mapping):
        raise ProfileError(f"'back_to_back' must map devices to their calibration, got {raw!r}")
    out = {}
    for device, c in raw.items():
        if not isinstance(c, Mapping) or set(c) != {"step_s", "alone_s", "overhead_s"}:
            raise ProfileError(f"back_to_back[{device!r}] needs exactly step_s, alone_s and overhead_s, got {c!r}")
        out[str(device)] = BackToBack(**{k: _number(c[k], f"back_to_back[{device!r}].{k}") for k in c})
    return out


def _number(x: Any, name: str) -> float:
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        raise ProfileError(f"{name} must be a number of seconds, got {x!r}")
    return float(x)


def check_device_roles(devices: Sequence[str], stores: Sequence[str] = ()) -> None:
    """Raise unless the compute devices and the stores are distinct names and there is a compute device."""
    names = [*devices, *stores]
    if not devices or len(set(names)) != len(names):
        both = sorted(set(devices) & set(stores))
        if both:
            raise ProfileError(
                f"device {both[0]} is both a compute device and a store: a store runs no op, name it once, as a store",
                device=both[0],
            )
        raise ProfileError(f"profile needs distinct devices and at least one compute device, got {names}")


def _check_roles(p: Profile) -> None:
    """The typed keys: every store a device of the profile that runs no op; `profiling` a mapping whose wall_s, if
    given, is a finite non-negative number."""
    if not isinstance(p.stores, tuple):
        raise ProfileError(f"'stores' must be a list of device names, got {p.stores!r}")
    for s in p.stores:
        if not isinstance(s, str) or s not in p.devices:
            raise ProfileError(f"store {s!r} is not among the profile's devices {sorted(p.devices)}", device=str(s))
        if p.compute.get(s):
            raise ProfileError(f"store {s!r} has compute costs; a store runs no op", device=s)
    if not isinstance(p.modelled, bool):
        raise ProfileError(f"'modelled' must be true or false, got {p.modelled!r}")
    if p.profiling is not None:
        if not isinstance(p.profiling, Mapping):
            raise ProfileError(f"'profiling' must be a mapping, got {p.profiling!r}")
        wall = p.profiling.get("wall_s", 0.0)
        if isinstance(wall, bool) or not isinstance(wall, (int, float)) or not _ok(float(wall)):
            raise ProfileError(f"profiling.wall_s must be a finite non-negative number of seconds, got {wall!r}")
    for device, b in p.back_to_back.items():
        if not p.compute.get(device):
            raise ProfileError(f"back_to_back names {device!r}, which runs no op in this profile", device=device)
        if not isinstance(b, BackToBack) or not (_ok(b.step_s) and _ok(b.alone_s) and math.isfinite(b.overhead_s)):
            raise ProfileError(
                f"back_to_back[{device!r}] needs finite seconds (step and alone non-negative), got {b!r}", device=device
            )


def validate_profile(p: Profile, where: str = "profile") -> None:
    for d, ops in p.compute.items():
        if d not in p.devices:
            raise ProfileError(f"{where}: compute costs for a device missing from 'devices'", device=d)
        for op, c in ops.items():
            if not (_ok(c.time_s) and _ok(c.energy_j) and c.workspace_bytes >= 0):
                raise ProfileError(f"{where}: op cost must be finite and non-negative, got {c}", op=op, device=d)
    for key, link in p.copy.items():
        src, arrow, dst = key.partition("->")
        if not arrow or src not in p.devices or dst not in p.devices:
            raise ProfileError(f"{where}: copy link {key!r} is not 'src->dst' over the profile's devices", device=src)
        if not (_ok(link.latency_s) and math.isfinite(link.bytes_per_s) and link.bytes_per_s > 0):
            raise ProfileError(
                f"{where}: copy link needs latency >= 0 and bandwidth > 0, got {link.latency_s}, {link.bytes_per_s}",
                device=key,
            )
        if not all(_ok(t) for t in link.per_value.values()):
            raise ProfileError(f"{where}: per-value copy times must be finite and non-negative", device=key)


def _ok(x: float) -> bool:
    return math.isfinite(x) and x >= 0
