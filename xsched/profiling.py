"""Profiling: measure every op on every device and every copy between them, and the profile store in profiles/."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import itertools
import json
import logging
import math
import os
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from xsched.devices.base import (
    DEFAULT_POLICY,
    Device,
    DeviceError,
    Measurement,
    Policy,
    fit_link,
    get_device,
    installed_kinds,
    split_device_list,
)
from xsched.errors import ProfileError
from xsched.graph import Graph, Op
from xsched.profile import LinkCost, OpCost, Profile

log = logging.getLogger("xsched.profiling")

PROFILES_DIR = Path("profiles")
COPY_SIZES = (4 << 10, 64 << 10, 1 << 20, 8 << 20, 32 << 20)  # bytes: spans the latency- and bandwidth-bound regimes
ROUNDS = 3  # passes over all ops on a real device (see profile_graph)
PER_VALUE = 8  # the largest values also get a measured copy time of their own on every measured link


# ---- the measuring loop ----
def op_signature(graph: Graph, op: Op) -> str:
    """Ops with equal signatures cost the same: target, input/output shapes and dtypes, and call args (refs by position)."""
    if op.call is None:
        return json.dumps(["uncallable", op.id])
    slot = {v: i for i, v in enumerate(dict.fromkeys(op.inputs))}

    def canon(x: Any) -> Any:
        if isinstance(x, list):
            return [canon(y) for y in x]
        if isinstance(x, dict):
            if "ref" in x:
                return {"ref": slot.get(x["ref"], "?"), "view": x.get("view")}
            return {k: canon(v) for k, v in x.items()}
        return x

    ins = [[graph.value[v].shape, graph.value[v].dtype] for v in op.inputs]
    outs = [[graph.value[v].shape, graph.value[v].dtype] for v in op.outputs]
    return json.dumps([op.target, ins, outs, canon(dict(op.call))], sort_keys=True, default=str)


def signature_groups(graph: Graph) -> dict[str, list[str]]:
    groups: dict[str, list[str]] = {}
    for op in graph.ops:
        groups.setdefault(op_signature(graph, op), []).append(op.id)
    return groups


def copy_seconds(src: Device, dst: Device, nbytes: int, pinned: bool = True) -> float:
    """Seconds to copy nbytes from src to dst, as whichever of the two plugins knows the link says."""
    t = src.copy_seconds(dst, nbytes, outgoing=True, pinned=pinned)
    if t is None:
        t = dst.copy_seconds(src, nbytes, outgoing=False, pinned=pinned)
    if t is None:
        raise DeviceError(
            f"neither the {src.kind} nor the {dst.kind} plugin can time a copy {src.name}->{dst.name}", device=dst.name
        )
    return t


def profile_graph(
    graph: Graph,
    devices: Sequence[str | Device],
    *,
    policy: Policy = DEFAULT_POLICY,
    max_total_s: float | None = None,
    pinned: bool = True,
    copy_sizes: Sequence[int] = COPY_SIZES,
    per_value: int = PER_VALUE,
    rounds: int = ROUNDS,
    progress: bool = True,
) -> Profile:
    """Measure (or model) every op on every device and fit every ordered device pair's copy cost.

    Ops with one signature are measured once per round; a real device goes `rounds` times through all of them and
    keeps each op's median over the rounds, so a burst of load from other processes spoils one round of an op,
    not its cost. Once `max_total_s` is spent, the remaining rounds get the quick policy.
    `pinned` says which host memory the `copy` entries assume; the other kind's fit is in extra["links"].
    An op a device cannot run is left out of that device's costs (contract 2), its reason in extra["unsupported"].
    """
    from tqdm.auto import tqdm

    devs = [get_device(d) for d in devices]
    names = [d.name for d in devs]
    if not devs or len(set(names)) != len(names):
        raise ProfileError(f"profile needs distinct devices, got {names}")
    groups = signature_groups(graph)
    pairs = list(itertools.permutations(devs, 2))
    start = time.perf_counter()
    compute: dict[str, dict[str, OpCost]] = {d.name: {} for d in devs}
    unsupported: dict[str, dict[str, str]] = {}
    sources: dict[str, set[str]] = {d.name: set() for d in devs}
    flops: dict[str, float] = {}
    bar = tqdm(
        total=sum(1 if d.simulated else rounds for d in devs) * len(groups) + len(pairs),
        desc=f"profile {graph.name}",
        unit="op",
        disable=not progress,
        leave=False,
    )
    with bar:
        for d in devs:
            bar.set_postfix_str(d.name)
            found = _measure_device(d, graph, groups, policy, 1 if d.simulated else rounds, start, max_total_s, bar)
            for op_ids, ms in found.items():
                if isinstance(ms, str):
                    unsupported.setdefault(d.name, {}).update(dict.fromkeys(op_ids, ms))
                    continue
                cost = OpCost(
                    statistics.median(m.time_s for m in ms),
                    statistics.median(m.energy_j for m in ms),
                    max(m.workspace_bytes for m in ms),
                )
                compute[d.name].update(dict.fromkeys(op_ids, cost))
                sources[d.name].update(m.energy_source for m in ms)
                if ms[0].flops is not None:
                    flops.update(dict.fromkeys(op_ids, ms[0].flops))
        copy, links = {}, {}
        largest = sorted((v for v in graph.values if v.nbytes > 0), key=lambda v: -v.nbytes)[:per_value]
        for a, b in pairs:
            bar.set_postfix_str(f"{a.name}->{b.name}")
            copy[f"{a.name}->{b.name}"], links[f"{a.name}->{b.name}"] = _link(a, b, copy_sizes, largest, pinned)
            bar.update()
    for d, ops in unsupported.items():
        log.warning("%d ops cannot run on %s (see extra['unsupported'])", len(ops), d)
    extra = {
        "torch_version": torch.__version__,
        "graph_name": graph.name,
        "profiling": {
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "wall_s": round(time.perf_counter() - start, 3),
            "policy": dataclasses.asdict(policy),
            "max_total_s": max_total_s,
            "pinned": pinned,
            "ops": len(graph.ops),
            "signatures": len(groups),
        },
        "flops": flops,
        "links": links,
        **({"unsupported": unsupported} if unsupported else {}),
    }
    energy_source = {d.name: "+".join(sorted(sources[d.name])) or d.energy_source for d in devs}
    return Profile(graph.fingerprint, {d.name: d.info() for d in devs}, compute, copy, energy_source, extra)


def _measure_device(
    d: Device,
    graph: Graph,
    groups: dict[str, list[str]],
    policy: Policy,
    rounds: int,
    start: float,
    max_total_s: float | None,
    bar: Any,
) -> dict[tuple[str, ...], list[Measurement] | str]:
    """Per signature group: its measurements over the rounds, or why the device cannot run it. Each round hands
    the device the runnable groups' first ops at once (Device.measure_ops), in graph order as signature_groups."""
    found: dict[tuple[str, ...], list[Measurement] | str] = {tuple(ids): [] for ids in groups.values()}
    for _ in range(rounds):
        todo = [k for k, ms in found.items() if not isinstance(ms, str)]
        late = max_total_s is not None and time.perf_counter() - start >= max_total_s  # checked once per round
        results = d.measure_ops(graph, [graph.op[k[0]] for k in todo], policy.quick() if late else policy)
        for op_ids, m in zip(todo, results, strict=True):
            if isinstance(m, str):
                found[op_ids] = m
            else:
                found[op_ids].append(m)  # type: ignore[union-attr]
        bar.update(len(found))
    return found


def _link(
    a: Device, b: Device, sizes: Sequence[int], largest: Sequence[Any], pinned: bool
) -> tuple[LinkCost, dict[str, Any]]:
    """The copy cost a->b: a latency + bandwidth fit over `sizes`, and measured times for the largest values."""
    modes = [pinned] if a.is_host and b.is_host else [pinned, not pinned]  # memcpy: no pinned/pageable
    detail: dict[str, Any] = {"sizes": list(sizes)}
    fits = {}
    for mode in modes:
        seconds = [copy_seconds(a, b, n, mode) for n in sizes]
        fits[mode] = fit_link(sizes, seconds)
        detail["pinned" if mode else "pageable"] = {
            "latency_s": fits[mode][0],
            "bytes_per_s": fits[mode][1],
            "seconds": seconds,
        }
    # a modelled link is exactly its fit; a measured one also times the largest values themselves
    per_value = {} if a.simulated or b.simulated else {v.id: copy_seconds(a, b, v.nbytes, pinned) for v in largest}
    return LinkCost(fits[pinned][0], fits[pinned][1], per_value), detail


# ---- the store ----
def default_profile_path(graph: Graph, devices: Sequence[str]) -> Path:
    tag = "_".join(d.replace(":", "-").replace("#", "-").replace("=", "") for d in devices)
    return PROFILES_DIR / f"{graph.name or 'graph'}-{graph.fingerprint[:12]}-{tag}.json".replace("/", "_")


def save_profile(profile: Profile, path: str | Path) -> Path:
    """Write the profile atomically: a temp file in the same folder, fsync, rename; an interrupted save loses nothing."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        text = json.dumps(profile.to_dict(), indent=1, allow_nan=False) + "\n"
    except ValueError as e:
        raise ProfileError(f"profile has a non-finite number and cannot be saved as JSON: {e}") from e
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return path


def read_profile(path: str | Path) -> Profile:
    """Load and validate a profile file; a corrupt or ill-formed one is a ProfileError saying what is wrong."""
    if not Path(path).exists():
        raise ProfileError(f"no profile file at {path}")
    profile = Profile.load(path)
    validate_profile(profile, str(path))
    return profile


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


def check_profile(
    profile: Profile, graph: Graph, devices: Sequence[str] | None = None, *, check_machine: bool = True
) -> None:
    """Raise a ProfileError naming what differs: the graph, a missing device, torch's version or a device fingerprint.

    check_machine=False keeps the graph and device-name checks only: planning on another machine than the one
    that was profiled (the profile's own fingerprints still say where its numbers come from)."""
    if profile.graph != graph.fingerprint:
        made_for = profile.extra.get("graph_name", "?")
        raise ProfileError(
            f"profile is for graph {profile.graph} ({made_for!r}), not this graph {graph.fingerprint} ({graph.name!r})"
        )
    names = list(devices) if devices is not None else list(profile.devices)
    for name in names:
        if name not in profile.devices:
            raise ProfileError(
                f"profile has no costs for device {name} (it has {', '.join(profile.devices)})", device=name
            )
    if not check_machine:
        return
    stored_torch = profile.extra.get("torch_version")
    if stored_torch is not None and stored_torch != torch.__version__:
        raise ProfileError(f"profile was measured with torch {stored_torch}, this is torch {torch.__version__}")
    kinds = installed_kinds()
    for name in names:
        if name.split(":", 1)[0] not in kinds:
            continue  # costs from elsewhere (an imported bench profile): nothing here to compare with
        stored, now = profile.devices[name], get_device(name)
        if stored.fingerprint != now.fingerprint:
            parts, cur = dict(stored.extra.get("fingerprint_parts", {})), now.fingerprint_parts()
            diff = [
                f"{k}: {parts.get(k)!r} -> {cur.get(k)!r}"
                for k in sorted(set(parts) | set(cur))
                if parts.get(k) != cur.get(k)
            ]
            raise ProfileError(
                f"device differs from the one profiled ({'; '.join(diff) or 'fingerprint'})", device=name
            )


def load_profile(
    path: str | Path,
    graph: Graph,
    devices: Sequence[str] | None = None,
    reprofile: bool = False,
    *,
    check_machine: bool = True,
    **profile_kwargs: Any,
) -> Profile:
    """The stored profile for `graph` on `devices`; a stale, foreign or corrupt one is an error, or re-profiled and saved."""
    profile = None
    try:
        profile = read_profile(path)
        check_profile(profile, graph, devices, check_machine=check_machine)
        return profile
    except ProfileError as e:
        if not reprofile:
            raise
        names = list(devices) if devices is not None else list(profile.devices) if profile is not None else None
        if not names:
            raise ProfileError(f"{e.detail}; and cannot re-profile without knowing the devices (pass devices=)") from e
        log.warning("re-profiling %s on %s: %s", graph.name, ", ".join(names), e.detail)
    fresh = profile_graph(graph, names, **profile_kwargs)
    save_profile(fresh, path)
    return fresh


# ---- command line (wired into xsched/cli.py by the lead) ----
def cli_devices(args: Any) -> int:
    """`xsched devices [--json] [--no-sim]`: what this machine has, and the simulated specs."""
    from xsched.budgets import format_bytes
    from xsched.devices.base import available_devices

    rows = available_devices(include_sim=not getattr(args, "no_sim", False))
    if getattr(args, "json", False):
        print(json.dumps([dataclasses.asdict(r) for r in rows], indent=1, default=str))
        return 0
    width = max((len(r.name) for r in rows), default=4)
    for r in rows:
        keys = ("logical_cores", "energy", "driver", "power_limit_w", "spec")
        extra = ", ".join(f"{k}={v}" for k, v in r.details.items() if k in keys)
        if r.kind == "sim":
            d = r.details
            extra = (
                f"simulated: {d['peak_float32_flops'] / 1e12:.3g} TFLOP/s fp32, {d['memory_bandwidth'] / 1e9:.4g} GB/s"
            )
        print(
            f"{r.name:<{width}}  {format_bytes(r.memory_bytes):>10}  {r.description}"
            + (f"  [{extra}]" if extra else "")
        )
    return 0


def cli_profile(args: Any) -> int:
    """`xsched profile MODEL|graph.json --devices cpu,cuda:0,sim:h100 -o profile.json [--reps N] [--max-time S]`."""
    graph = getattr(args, "graph", None)
    if not isinstance(graph, Graph):
        from xsched.cli import load_graph

        graph = load_graph(args.model, batch=getattr(args, "batch", None), scale=getattr(args, "scale", "default"))
    names = split_device_list(str(args.devices))
    base = Policy()
    policy = dataclasses.replace(base, max_reps=getattr(args, "reps", None) or base.max_reps)
    profile = profile_graph(
        graph,
        names,
        policy=policy,
        max_total_s=getattr(args, "max_time", None),
        pinned=not getattr(args, "pageable", False),
        progress=not getattr(args, "quiet", False),
    )
    out = save_profile(profile, getattr(args, "output", None) or default_profile_path(graph, names))
    wall = profile.extra["profiling"]["wall_s"]
    print(
        f"{graph.name}: {len(graph.ops)} ops ({profile.extra['profiling']['signatures']} distinct) on {len(names)} devices in {wall:.1f} s -> {out}"
    )
    for d in names:
        ops = profile.compute[d]
        total = sum(c.time_s for c in ops.values())
        print(
            f"  {d:<16} {len(ops):>5}/{len(graph.ops)} ops  sum {total * 1e3:10.3f} ms  energy: {profile.energy_source[d]}"
        )
    for key, link in profile.copy.items():
        print(f"  {key:<32} {link.latency_s * 1e6:8.2f} us + {link.bytes_per_s / 1e9:8.2f} GB/s")
    return 0
