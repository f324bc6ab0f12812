"""The profile store (profiles/): where a graph's profile lives, atomic saves, and the one loader, which validates
the file and checks it is for this graph, these devices and this machine (or re-measures it)."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from xsched.contracts.graph import Graph
from xsched.contracts.profile import Profile
from xsched.devices.base import Device, Policy, get_device, installed_kinds
from xsched.errors import ProfileError
from xsched.files import atomic_write

log = logging.getLogger("xsched.profiling")

PROFILES_DIR = Path("profiles")


def default_profile_path(graph: Graph, devices: Sequence[str], stores: Sequence[str] = ()) -> Path:
    """profiles/<graph>-<fingerprint>-<devices>[_store-<stores>].json: a profile with stores is another file than
    one without (its stores have no op costs)."""

    def tag(names: Sequence[str]) -> str:
        return "_".join(d.replace(":", "-").replace("#", "-").replace("=", "") for d in names)

    stored = f"_store-{tag(stores)}" if stores else ""
    name = f"{graph.name or 'graph'}-{graph.fingerprint[:12]}-{tag(devices)}{stored}.json"
    return PROFILES_DIR / name.replace("/", "_")


def save_profile(profile: Profile, path: str | Path) -> Path:
    """Write the profile atomically: a temp file in the same folder, fsync, rename; an interrupted save loses nothing."""
    try:
        text = json.dumps(profile.to_dict(), indent=1, allow_nan=False) + "\n"
    except ValueError as e:
        raise ProfileError(f"profile has a non-finite number and cannot be saved as JSON: {e}") from e
    return atomic_write(path, lambda f: f.write(text.encode()))


def check_profile(
    profile: Profile,
    graph: Graph,
    devices: Sequence[str] | None = None,
    *,
    check_machine: bool = True,
    retry_left_out: bool = False,
) -> None:
    """Raise a ProfileError naming what differs: the graph, a missing device, torch's version or a device fingerprint;
    with `retry_left_out`, an op the profile left out as unsupported that runs on its device now.

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
    import torch  # here, not at the top: planning from a stored profile (check_machine off) needs no torch

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
        if retry_left_out:
            _check_left_out(profile, graph, name, now)


def _check_left_out(profile: Profile, graph: Graph, device: str, plugin: Device) -> None:
    """A ProfileError where an op the profile left out as unsupported on `device` runs there now (an older
    profiler's inputs that the op refused, say): each is tried once, quickly; a profile without any passes free."""
    left_out = [graph.op[o] for o in profile.extra.get("unsupported", {}).get(device, {}) if o in graph.op]
    if not left_out:
        return
    tried = plugin.measure_ops(graph, left_out, Policy().quick())
    runs = [op for op, m in zip(left_out, tried, strict=True) if not isinstance(m, str)]
    if runs:
        raise ProfileError(
            f"{len(runs)} of the {len(left_out)} ops the profile left out as unsupported run now (first {runs[0].id}, "
            f"{runs[0].target})",
            device=device,
            op=runs[0].id,
        )


def load_profile(
    path: str | Path,
    graph: Graph | None = None,
    devices: Sequence[str] | None = None,
    reprofile: bool = False,
    *,
    check_machine: bool = True,
    stores: Sequence[str] = (),
    measure: Callable[..., Profile] | None = None,
    **profile_kwargs: Any,
) -> Profile:
    """The stored profile, validated; with `graph`, checked to be for `graph` on `devices` (stores included) and
    (unless `check_machine` is off) this machine. A stale, foreign or corrupt one is a ProfileError, or with
    `reprofile` (where an op it left out as unsupported runs now is stale too) measured again by `measure` (default
    profile_graph; ops on the devices that are not `stores`, or not the stored profile's stores) and saved."""
    profile = None
    try:
        if not Path(path).exists():
            raise ProfileError(f"no profile file at {path}")
        profile = Profile.load(path)
        if graph is not None:
            # measuring again is allowed: a fix since may make an op the profile left out run
            check_profile(profile, graph, devices, check_machine=check_machine, retry_left_out=reprofile)
        return profile
    except ProfileError as e:
        if not reprofile or graph is None:
            raise
        names = list(devices) if devices is not None else list(profile.devices) if profile is not None else None
        if not names:
            raise ProfileError(f"{e.detail}; and cannot re-profile without knowing the devices (pass devices=)") from e
        if devices is None and profile is not None and not stores:
            stores = list(profile.stores)
        log.warning("re-profiling %s on %s: %s", graph.name, ", ".join(names), e.detail)
    if measure is None:
        from xsched.profiling.measure import profile_graph as measure  # measuring imports torch

    fresh = measure(graph, [n for n in names if n not in stores], stores=list(stores), **profile_kwargs)
    save_profile(fresh, path)
    return fresh
