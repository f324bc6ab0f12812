"""Device spec files (xsched/devices/specs/*.toml, a project's devices/, $XSCHED_DEVICES_PATH): reading, finding by
name or alias, and what a `sim:` device name stands for. Free of torch, so plans and reports on graph files can use
them."""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser, as a package
    import tomli as tomllib  # type: ignore[no-redef]

from xsched.devices.base import DeviceError

log = logging.getLogger("xsched.devices")

SPEC_PATH_ENV = "XSCHED_DEVICES_PATH"


@dataclass(frozen=True)
class DeviceSpec:
    """A device description file (xsched/devices/specs/*.toml)."""

    name: str
    title: str
    kind: str  # "gpu" | "cpu"
    peak_flops: Mapping[str, float]
    memory_bandwidth: float
    memory_bytes: int
    link_bandwidth: float
    link_latency_s: float
    launch_overhead_s: float
    idle_power_w: float
    max_power_w: float
    pageable_bandwidth: float | None = None
    peer_bandwidth: float | None = None
    peer_latency_s: float | None = None
    aliases: tuple[str, ...] = ()
    match: tuple[str, ...] = ()  # substrings of real device names this spec describes (for their modelled energy)
    path: str = ""
    raw: Mapping[str, Any] = field(default_factory=dict)

    @property
    def power(self) -> dict[str, float]:
        return {"idle_power_w": self.idle_power_w, "max_power_w": self.max_power_w}

    def peak(self, dtype: str | None) -> float:
        return self.peak_flops.get(dtype or "float32") or self.peak_flops["float32"]

    @property
    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.raw, sort_keys=True, default=str).encode()).hexdigest()[:16]


def spec_dirs() -> list[Path]:
    """Where specs are looked up, earlier first: the $XSCHED_DEVICES_PATH folders, a `devices/` folder in the
    current directory (a checkout's or a project's own editable specs), then the specs shipped with the package."""
    dirs = [Path(p) for p in os.environ.get(SPEC_PATH_ENV, "").split(os.pathsep) if p]
    dirs.append(Path.cwd() / "devices")
    dirs.append(Path(__file__).resolve().parent / "specs")
    return list(dict.fromkeys(d for d in dirs if d.is_dir()))


def spec_files() -> dict[str, Path]:
    """Spec name (file stem) -> path; earlier directories win."""
    found: dict[str, Path] = {}
    for d in spec_dirs():
        for p in sorted(d.glob("*.toml")):
            found.setdefault(p.stem, p)
    return found


def all_specs() -> dict[str, DeviceSpec]:
    """Every readable spec; a broken file is skipped here with a warning (loading it by name says what is wrong)."""
    specs = {}
    for name, path in spec_files().items():
        try:
            specs[name] = read_spec(path)
        except DeviceError as e:
            log.warning("skipping device spec %s: %s", path, e.detail)
    return specs


def load_spec(name: str) -> DeviceSpec:
    """A spec by file stem, alias, or path to a .toml file."""
    if name.endswith(".toml"):
        return read_spec(Path(name))
    files = spec_files()
    if name in files:
        return read_spec(files[name])
    for spec in all_specs().values():
        if name in spec.aliases:
            return spec
    where = ", ".join(str(d) for d in spec_dirs()) or f"no spec folder (set ${SPEC_PATH_ENV})"
    raise DeviceError(
        f"no device spec named {name!r} in {where}; specs: {', '.join(sorted(files)) or 'none'}", device=f"sim:{name}"
    )


@functools.cache
def _read_spec_cached(path: str, mtime: float) -> DeviceSpec:
    try:
        raw = tomllib.loads(Path(path).read_text())
    except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise DeviceError(f"cannot read device spec {path}: {e}") from e
    return _spec_from_dict(raw, path)


def read_spec(path: Path) -> DeviceSpec:
    try:
        mtime = path.stat().st_mtime
    except OSError as e:
        raise DeviceError(f"cannot read device spec {path}: {e}") from e
    return _read_spec_cached(str(path), mtime)


def _spec_from_dict(raw: Mapping[str, Any], path: str) -> DeviceSpec:
    def need(table: Mapping[str, Any], key: str, where: str = "") -> Any:
        if key not in table:
            raise DeviceError(f"device spec {path} lacks field {where}{key!r}")
        return table[key]

    try:
        link, peer = dict(need(raw, "link")), dict(raw.get("peer", {}))
        peaks = {str(k): float(v) for k, v in dict(need(raw, "peak_flops")).items()}
        if "float32" not in peaks:
            raise DeviceError(f"device spec {path} lacks peak_flops.float32 (the rate of unlisted dtypes)")
        spec = DeviceSpec(
            name=str(raw.get("name", Path(path).stem)),
            title=str(raw.get("title", raw.get("name", Path(path).stem))),
            kind=str(need(raw, "kind")),
            peak_flops=peaks,
            memory_bandwidth=float(need(raw, "memory_bandwidth")),
            memory_bytes=int(need(raw, "memory_bytes")),
            link_bandwidth=float(need(link, "bandwidth", "link.")),
            link_latency_s=float(need(link, "latency_s", "link.")),
            launch_overhead_s=float(need(raw, "launch_overhead_s")),
            idle_power_w=float(need(raw, "idle_power_w")),
            max_power_w=float(need(raw, "max_power_w")),
            pageable_bandwidth=float(link["pageable_bandwidth"]) if "pageable_bandwidth" in link else None,
            peer_bandwidth=float(peer["bandwidth"]) if "bandwidth" in peer else None,
            peer_latency_s=float(peer.get("latency_s", link["latency_s"])) if peer else None,
            aliases=tuple(str(a) for a in raw.get("aliases", ())),
            match=tuple(str(a) for a in raw.get("match", ())),
            path=str(path),
            raw=dict(raw),
        )
    except (TypeError, ValueError) as e:
        raise DeviceError(f"device spec {path} has a field of the wrong type: {e}") from e
    if spec.kind not in ("gpu", "cpu"):
        raise DeviceError(f"device spec {path}: kind must be 'gpu' or 'cpu', got {spec.kind!r}")
    bad = [k for k in ("memory_bandwidth", "link_bandwidth", "max_power_w") if getattr(spec, k) <= 0]
    bad += [f"peak_flops.{k}" for k, v in spec.peak_flops.items() if v <= 0]
    if bad:
        raise DeviceError(f"device spec {path}: {', '.join(bad)} must be positive")
    return spec


def match_spec(description: str, kind: str) -> DeviceSpec | None:
    """The spec whose `match` substrings name this real device (e.g. 'NVIDIA H100 80GB HBM3'), if any."""
    for spec in all_specs().values():
        if spec.kind == kind and any(m.lower() in description.lower() for m in spec.match):
            return spec
    return None


def sim_spec(device: str) -> DeviceSpec:
    """The spec a simulated device name stands for: 'sim:h100' and 'sim:h100#1' (a second instance) both h100's."""
    _, _, rest = device.partition(":")
    spec_name, _, instance = rest.partition("#")
    if not spec_name:
        raise DeviceError("a simulated device needs a spec: sim:<spec>[#instance], e.g. sim:h100", device=device)
    if instance and not instance.isdigit():
        raise DeviceError(f"instance after '#' must be a number, got {instance!r}", device=device)
    return load_spec(spec_name)


def target_device_type(devices: Sequence[str]) -> str:
    """The device type a graph planned over `devices` (plan device names, stores included) is typed for: "cuda"
    where any is a GPU, a simulated one by its spec's kind (its kernels then make what the graph says, as in its
    eager run: fused dropout, a GPU's layer-norm dtypes), else "cpu"."""
    gpu = any(d.startswith("cuda") or (d.startswith("sim:") and sim_spec(d).kind == "gpu") for d in devices)
    return "cuda" if gpu else "cpu"
