"""Simulated devices: an analytic roofline from a TOML spec in xsched/devices/specs/ (peak FLOP/s, bandwidths, power).

Op time   = max(flops / peak_flops[dtype], bytes / memory_bandwidth) + launch_overhead_s, where flops come
            from torch's FlopCounterMode running the op on meta tensors and bytes are the op's input and
            output nbytes. A dtype the spec does not list runs at its float32 rate.
Op energy = (idle_power_w + (max_power_w - idle_power_w) * u) * time, u = roofline time / total time
            (the fraction of the op's time the device is busy rather than waiting on the launch).
Copies    = latency_s + nbytes / bandwidth over the spec's host [link] (pageable_bandwidth for pageable
            host memory), its [peer] link between two instances of one GPU spec, or both host links in
            turn between two different simulated GPUs.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser, as a package
    import tomli as tomllib  # type: ignore[no-redef]

from xsched.contracts.graph import Graph, Op
from xsched.contracts.profile import DeviceInfo
from xsched.devices.base import DEFAULT_POLICY, Device, DeviceError, DeviceInfoRow, Measurement, Policy
from xsched.devices.energy import modelled_energy
from xsched.devices.stand_in import op_stand_in_workspace

log = logging.getLogger("xsched.devices")
MODEL_VERSION = "roofline/2"  # part of every sim fingerprint: bump when the formulas above change
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


# ---- FLOPs ----
_FLOPS: dict[tuple[str, str], float] = {}  # (graph fingerprint, op id) -> FLOPs: every sim device shares the count


def op_flops(graph: Graph, op: Op) -> float:
    """FLOPs of one call of `op`, counted by FlopCounterMode on meta tensors (0 for ops torch counts as free)."""
    key = (graph.fingerprint, op.id)
    if key not in _FLOPS:
        if len(_FLOPS) > 1_000_000:
            _FLOPS.clear()
        _FLOPS[key] = _count_flops(graph, op)
    return _FLOPS[key]


def _count_flops(graph: Graph, op: Op) -> float:
    from torch.utils.flop_counter import FlopCounterMode

    from xsched.contracts import torch_ops as ops

    if not ops.is_executable(op):
        raise DeviceError("op has no executable call: its FLOPs cannot be counted", op=op.id)
    env = ops.op_input_tensors(graph, op, "meta")
    counter = FlopCounterMode(display=False)
    try:
        with counter:
            ops.run_op(op, env, "meta")
    except Exception:  # an op without a meta kernel: count on small real CPU tensors instead
        env = ops.op_input_tensors(graph, op, "cpu")
        counter = FlopCounterMode(display=False)
        with counter:
            ops.run_op(op, env, "cpu")
    return float(counter.get_total_flops())


def op_dtype(graph: Graph, op: Op) -> str | None:
    """The dtype that sets an op's peak rate: its first floating input, else its first floating output."""
    for vid in (*op.inputs, *op.outputs):
        dt = graph.value[vid].dtype
        if dt and getattr(torch, dt.removeprefix("torch."), None) is not None:
            if getattr(torch, dt.removeprefix("torch.")).is_floating_point:
                return dt.removeprefix("torch.")
    return None


def op_io_bytes(graph: Graph, op: Op) -> int:
    return sum(graph.value[v].nbytes for v in dict.fromkeys((*op.inputs, *op.outputs)))


def roofline(spec: DeviceSpec, flops: float, nbytes: int, dtype: str | None) -> tuple[float, float]:
    """(time_s, utilisation) of one op on the spec's device."""
    busy = max(flops / spec.peak(dtype), nbytes / spec.memory_bandwidth)
    total = busy + spec.launch_overhead_s
    return total, (busy / total if total > 0 else 0.0)


def _host_link(spec: DeviceSpec, nbytes: int, pinned: bool) -> float:
    bw = spec.link_bandwidth if pinned or not spec.pageable_bandwidth else spec.pageable_bandwidth
    return spec.link_latency_s + nbytes / bw


class SimDevice(Device):
    """'sim:h100' (spec h100-sxm via its alias), 'sim:h100#1' (a second instance), 'sim:path/to/spec.toml'."""

    kind = "sim"
    simulated = True

    def __init__(self, name: str) -> None:
        super().__init__(name)
        _, _, rest = name.partition(":")
        spec_name, _, instance = rest.partition("#")
        if not spec_name:
            raise DeviceError("a simulated device needs a spec: sim:<spec>[#instance], e.g. sim:h100", device=name)
        if instance and not instance.isdigit():
            raise DeviceError(f"instance after '#' must be a number, got {instance!r}", device=name)
        self.instance = int(instance or 0)
        self.spec = load_spec(spec_name)

    @property
    def memory_bytes(self) -> int:
        return self.spec.memory_bytes

    @property
    def description(self) -> str:
        return f"simulated {self.spec.title} ({self.spec.name}, instance {self.instance})"

    @property
    def is_host(self) -> bool:
        return self.spec.kind == "cpu"

    def fingerprint_parts(self) -> dict[str, str]:
        return {"spec": self.spec.name, "spec_digest": self.spec.digest, "model": MODEL_VERSION}

    def info(self) -> DeviceInfo:
        info = super().info()
        return DeviceInfo(info.kind, info.fingerprint, info.memory_bytes, {**info.extra, "spec": self.spec.name})

    def measure_op(self, graph: Graph, op: Op, policy: Policy = DEFAULT_POLICY) -> Measurement:
        from xsched.contracts import torch_ops as ops

        flops = op_flops(graph, op) if ops.is_executable(op) else 0.0  # cost-only graphs: a bandwidth-only roofline
        time_s, u = roofline(self.spec, flops, op_io_bytes(graph, op), op_dtype(graph, op))
        # a GPU runs a CPU-only kernel's stand-in (contracts/device_kernels), whose transient a measured CUDA
        # profile sees as workspace; the model counts its bound
        workspace = max(
            op.workspace_bytes, op_stand_in_workspace(graph, op, "cuda" if self.spec.kind == "gpu" else "cpu")
        )
        return Measurement(time_s, modelled_energy(time_s, self.spec.power, u), "model", workspace, 0, 0.0, flops)

    def copy_seconds(self, other: Device, nbytes: int, *, outgoing: bool, pinned: bool = True) -> float | None:
        s = self.spec
        o = other.spec if isinstance(other, SimDevice) else None
        if s.kind == "gpu":
            if o is not None and o.kind == "gpu":
                if o.name == s.name and s.peer_bandwidth:
                    return (s.peer_latency_s or 0.0) + nbytes / s.peer_bandwidth
                return self._host(nbytes, True) + _host_link(o, nbytes, True)  # staged through host memory
            return self._host(nbytes, pinned)
        if o is not None and o.kind == "gpu":
            return _host_link(o, nbytes, pinned)
        if o is None and not other.is_host:
            return None  # a real accelerator: its own plugin measures its link from host memory
        return s.link_latency_s + nbytes / s.link_bandwidth  # host memcpy

    def _host(self, nbytes: int, pinned: bool) -> float:
        return _host_link(self.spec, nbytes, pinned)

    @classmethod
    def discover(cls) -> list[DeviceInfoRow]:
        rows = []
        for name, spec in sorted(all_specs().items()):
            details = {"spec_kind": spec.kind, "aliases": list(spec.aliases), "path": spec.path}
            details["peak_float32_flops"] = spec.peak("float32")
            details["memory_bandwidth"] = spec.memory_bandwidth
            rows.append(DeviceInfoRow(f"sim:{name}", "sim", spec.title, spec.memory_bytes, details))
        return rows
