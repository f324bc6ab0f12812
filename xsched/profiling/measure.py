"""Measuring a profile: every op on every device and every copy between them, through the device plugins."""

from __future__ import annotations

import dataclasses
import datetime
import itertools
import json
import logging
import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch

from xsched.contracts.graph import Graph, Op
from xsched.contracts.profile import LinkCost, OpCost, Profile
from xsched.devices.base import (
    DEFAULT_POLICY,
    Device,
    DeviceError,
    Measurement,
    Policy,
    fit_link,
    get_device,
)
from xsched.errors import ProfileError

log = logging.getLogger("xsched.profiling")

COPY_SIZES = (4 << 10, 64 << 10, 1 << 20, 8 << 20, 32 << 20)  # bytes: spans the latency- and bandwidth-bound regimes
ROUNDS = 3  # passes over all ops on a real device (see profile_graph)
PER_VALUE = 8  # the largest values also get a measured copy time of their own on every measured link
CAP_CHECK_OPS = 16  # ops measured one at a time (not interleaved) between two checks of the time cap


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
    not its cost. Once `max_total_s` is spent, the remaining ops get the quick policy (checked every CAP_CHECK_OPS
    ops on a device that measures ops one at a time, once per round on one that interleaves them).
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
        # the time cap is checked every CAP_CHECK_OPS ops (a first round over hundreds of distinct ops at the full
        # policy, GPT-2 on a GPU, ran minutes past it); a device that interleaves a round's ops, so that each finds
        # its inputs cold (Device.measure_ops), still gets the whole round at once
        per_op = type(d).measure_ops is Device.measure_ops
        step = CAP_CHECK_OPS if max_total_s is not None and per_op else max(1, len(todo))
        for at in range(0, len(todo), step):
            chunk = todo[at : at + step]
            late = max_total_s is not None and time.perf_counter() - start >= max_total_s
            results = d.measure_ops(graph, [graph.op[k[0]] for k in chunk], policy.quick() if late else policy)
            for op_ids, m in zip(chunk, results, strict=True):
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


def extend_profile(
    graph: Graph, profile: Profile, devices: Sequence[str], *, pinned: bool = True, **kwargs: Any
) -> Profile:
    """`profile` plus the devices of `devices` it lacks: their op costs, the links among them and the links
    between each of them and each device already there (so one measured profile serves many what-ifs; the
    devices it has keep their costs). kwargs go to profile_graph for the new devices."""
    profile.check_graph(graph.fingerprint)
    new = [d for d in dict.fromkeys(devices) if d not in profile.devices]
    if not new:
        return profile
    add = profile_graph(graph, new, pinned=pinned, **kwargs)
    copy, links = {**profile.copy, **add.copy}, {**profile.extra.get("links", {}), **add.extra.get("links", {})}
    largest = sorted((v for v in graph.values if v.nbytes > 0), key=lambda v: -v.nbytes)[:PER_VALUE]
    for old in profile.devices:
        for a, b in ((old, n) for n in new):
            for src, dst in ((a, b), (b, a)):
                key = f"{src}->{dst}"
                copy[key], links[key] = _link(get_device(src), get_device(dst), COPY_SIZES, largest, pinned)
    extended = list(profile.extra.get("profiling", {}).get("extended", [])) + new
    extra = {
        **dict(profile.extra),
        "flops": {**profile.extra.get("flops", {}), **add.extra.get("flops", {})},
        "links": links,
        "profiling": {**profile.extra.get("profiling", {}), "extended": extended},
    }
    if "unsupported" in add.extra:
        extra["unsupported"] = {**profile.extra.get("unsupported", {}), **add.extra["unsupported"]}
    return Profile(
        profile.graph,
        {**profile.devices, **add.devices},
        {**profile.compute, **add.compute},
        copy,
        {**profile.energy_source, **add.energy_source},
        extra,
    )
