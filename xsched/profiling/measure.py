"""Measuring a profile: every op on every device and every copy between them (and the stores), through the device
plugins, within an overall time cap."""

from __future__ import annotations

import dataclasses
import datetime
import itertools
import json
import logging
import statistics
from collections.abc import Callable, Sequence
from typing import Any

import torch

from xsched.contracts.graph import Graph, Op
from xsched.contracts.profile import OpCost, Profile, check_device_roles
from xsched.devices.base import DEFAULT_POLICY, Device, DeviceError, Policy, get_device
from xsched.errors import ProfileError
from xsched.profiling.fallback import FALLBACK_RULE, roofline_costs
from xsched.profiling.links import Link, measure_link, measure_links
from xsched.profiling.links import copy_seconds as copy_seconds  # re-exported: scripts time links with it
from xsched.profiling.rounds import Found, OpRounds
from xsched.profiling.timecap import TimeCap

log = logging.getLogger("xsched.profiling")

COPY_SIZES = (4 << 10, 64 << 10, 1 << 20, 8 << 20, 32 << 20)  # bytes: spans the latency- and bandwidth-bound regimes
ROUNDS = 3  # passes over all ops on a real device (see profile_graph)
PER_VALUE = 8  # the largest values also get a measured copy time of their own on every measured link
LINKS_SHARE = 0.2  # under a time cap, the copy sizes between the smallest and the largest stop at this share of it
VALUES_SHARE = 0.1  # under a time cap, the first round leaves up to this share of it to the largest values' copies


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


def profile_graph(
    graph: Graph,
    devices: Sequence[str | Device],
    *,
    stores: Sequence[str | Device] = (),
    policy: Policy = DEFAULT_POLICY,
    max_total_s: float | None = None,
    pinned: bool = True,
    copy_sizes: Sequence[int] = COPY_SIZES,
    per_value: int = PER_VALUE,
    rounds: int = ROUNDS,
    progress: bool = True,
) -> Profile:
    """Measure (or model) every op on every device of `devices` and fit the copy cost of every ordered pair of
    them, and of each device with each of `stores` both ways: a store holds values and runs no op, so it gets no
    compute entry and none of its ops are timed (`Profile.stores` names them).

    Ops with one signature are measured once per round; a real device goes `rounds` times through all of them and
    keeps each op's median over the rounds, so a burst of load from other processes spoils one round of an op,
    not its cost. `max_total_s` caps the whole run (device set-up, inputs, warm-up, samples, copies) within about
    one op's or one copy's time, in this order: the link fits (the smallest and the largest size whatever the cap,
    the others within LINKS_SHARE of it), the first round (rounds.py: the quick policy where the full one would not
    fit; up to VALUES_SHARE of the cap left over), the largest values' copies, the later rounds. An op left
    unmeasured is modelled from what its device reached (fallback.py) and listed in extra["modelled_ops"]; a value's
    copy left untimed is costed by the link's fit.
    `pinned` says which host memory the `copy` entries assume; the other kind's fit is in extra["links"].
    An op a device cannot run is left out of that device's costs (contract 2, docs/ARCHITECTURE.md), its reason in
    extra["unsupported"].
    """
    from tqdm.auto import tqdm

    cap = TimeCap(max_total_s)
    devs = [get_device(d) for d in devices]
    store_devs = [_store_device(s) for s in stores]
    check_device_roles([d.name for d in devs], [s.name for s in store_devs])
    groups = signature_groups(graph)
    pairs = list(itertools.permutations(devs, 2)) + [p for d in devs for s in store_devs for p in ((d, s), (s, d))]
    bar = tqdm(
        total=sum(1 if d.simulated else rounds for d in devs) * len(groups) + len(pairs),
        desc=f"profile {graph.name}",
        unit="op",
        disable=not progress,
        leave=False,
    )
    with bar:
        bar.set_postfix_str("copies")
        links = [Link(a, b, pinned) for a, b in pairs]
        measure_links(links, copy_sizes, cap, until=LINKS_SHARE * max_total_s if max_total_s is not None else None)
        bar.update(len(links))
        bar.set_postfix_str("ops")
        measured = OpRounds(devs, graph, groups, policy, cap, bar.update)
        largest = sorted((v for v in graph.values if v.nbytes > 0), key=lambda v: -v.nbytes)[:per_value]
        measured.first(reserve_s=min(VALUES_SHARE * (max_total_s or 0.0), sum(ln.values_s(largest) for ln in links)))
        for link in links:
            link.time_values(largest, cap)
        measured.later(rounds)
        costs = {d.name: _op_costs(graph, d, measured.found[d.name]) for d in devs}
    for d, c in costs.items():
        if c.unsupported:
            log.warning("%d ops cannot run on %s (see extra['unsupported'])", len(c.unsupported), d)
        if c.modelled:
            log.warning(
                "%d of %d ops on %s not measured within max_total_s: modelled", len(c.modelled), len(graph.ops), d
            )
    profiling: dict[str, Any] = {
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "wall_s": round(cap.spent(), 3),
        "policy": dataclasses.asdict(policy),
        "max_total_s": max_total_s,
        "pinned": pinned,
        "ops": len(graph.ops),
        "signatures": len(groups),
    }
    extra: dict[str, Any] = {
        "torch_version": torch.__version__,
        "graph_name": graph.name,
        "flops": {o: f for c in costs.values() for o, f in c.flops.items()},
        "links": {link.key: link.detail for link in links},
    }
    if any(c.unsupported for c in costs.values()):
        extra["unsupported"] = {d: c.unsupported for d, c in costs.items() if c.unsupported}
    if any(c.modelled for c in costs.values()):
        extra["modelled_ops"] = {d: c.modelled for d, c in costs.items() if c.modelled}
        profiling.update(modelled_ops={d: len(ops) for d, ops in extra["modelled_ops"].items()})
        profiling.update(fallback=FALLBACK_RULE)
    return Profile(
        graph.fingerprint,
        {d.name: d.info() for d in [*devs, *store_devs]},
        {**{d: c.compute for d, c in costs.items()}, **{s.name: {} for s in store_devs}},
        {link.key: link.cost() for link in links},
        {**{d: c.energy_source for d, c in costs.items()}, **{s.name: "model" for s in store_devs}},  # no op on a store
        extra,
        stores=tuple(s.name for s in store_devs),
        profiling=profiling,
    )


def check_runnable(graph: Graph, profile: Profile, devices: Sequence[str]) -> None:
    """Raise one line naming the model, the first op no device of `devices` can run, its operator and why (its
    error on the first device), instead of a solver's "no cost in the profile"."""
    why = profile.extra.get("unsupported", {})
    for op in graph.ops:
        if not any(op.id in profile.compute.get(d, {}) for d in devices):
            reason = next((why[d][op.id] for d in devices if op.id in why.get(d, {})), "no cost in the profile")
            model = graph.extra.get("model", graph.name)
            raise ProfileError(
                f"{model}: operator {op.target} (in module {op.name or '<root>'}) cannot run on any of "
                f"{', '.join(devices)}: {str(reason).splitlines()[0][:300]}",
                op=op.id,
            )


def _store_device(name: str | Device) -> Device:
    try:
        return get_device(name)
    except DeviceError as e:
        raise DeviceError(f"store {name}: {e.detail}", device=str(name)) from e


@dataclasses.dataclass
class _DeviceCosts:
    compute: dict[str, OpCost]
    unsupported: dict[str, str]
    modelled: list[str]
    flops: dict[str, float]
    energy_source: str


def _op_costs(graph: Graph, d: Device, found: Found) -> _DeviceCosts:
    """One device's op costs: each measured group's medians over its rounds, the unmeasured ones modelled."""
    compute: dict[str, OpCost] = {}
    unsupported: dict[str, str] = {}
    flops: dict[str, float] = {}
    sources: set[str] = set()
    missing: list[tuple[str, ...]] = []
    for op_ids, ms in found.items():
        if isinstance(ms, str):
            unsupported.update(dict.fromkeys(op_ids, ms))
        elif not ms:
            missing.append(op_ids)
        else:
            cost = OpCost(
                statistics.median(m.time_s for m in ms),
                statistics.median(m.energy_j for m in ms),
                max(m.workspace_bytes for m in ms),
            )
            compute.update(dict.fromkeys(op_ids, cost))
            sources.update(m.energy_source for m in ms)
            if ms[0].flops is not None:
                flops.update(dict.fromkeys(op_ids, ms[0].flops))
    measured = {k[0]: compute[k[0]] for k, ms in found.items() if ms and not isinstance(ms, str)}
    modelled = roofline_costs(graph, d, measured, [k[0] for k in missing]) if missing else {}
    for k in missing:
        compute.update(dict.fromkeys(k, modelled[k[0]]))
    if missing:
        sources.add("model")
    return _DeviceCosts(
        compute, unsupported, [o for k in missing for o in k], flops, "+".join(sorted(sources)) or d.energy_source
    )


def extend_profile(
    graph: Graph,
    profile: Profile,
    devices: Sequence[str],
    *,
    pinned: bool = True,
    measure: Callable[..., Profile] | None = None,
    **kwargs: Any,
) -> Profile:
    """`profile` plus the devices of `devices` it lacks: their op costs, the links among them and the links
    between each of them and each device already there (so one measured profile serves many what-ifs; the
    devices it has keep their costs). The new devices are measured by `measure` (default profile_graph; the
    execute layer's profile_calibrated adds their back-to-back calibration), kwargs going to it."""
    profile.check_graph(graph.fingerprint)
    new = [d for d in dict.fromkeys(devices) if d not in profile.devices]
    if not new:
        return profile
    add = (measure or profile_graph)(graph, new, pinned=pinned, **kwargs)
    copy, links = {**profile.copy, **add.copy}, {**profile.extra.get("links", {}), **add.extra.get("links", {})}
    largest = sorted((v for v in graph.values if v.nbytes > 0), key=lambda v: -v.nbytes)[:PER_VALUE]
    for old in profile.devices:
        for a, b in ((old, n) for n in new):
            for src, dst in ((a, b), (b, a)):
                key = f"{src}->{dst}"
                copy[key], links[key] = measure_link(get_device(src), get_device(dst), COPY_SIZES, largest, pinned)
    extended = list((profile.profiling or {}).get("extended", [])) + new
    extra = {
        **dict(profile.extra),
        "flops": {**profile.extra.get("flops", {}), **add.extra.get("flops", {})},
        "links": links,
    }
    for key in ("unsupported", "modelled_ops"):  # per device: the new devices' entries join the old ones
        if key in add.extra:
            extra[key] = {**profile.extra.get(key, {}), **add.extra[key]}
    return Profile(
        profile.graph,
        {**profile.devices, **add.devices},
        {**profile.compute, **add.compute},
        copy,
        {**profile.energy_source, **add.energy_source},
        extra,
        stores=profile.stores,
        modelled=profile.modelled,
        profiling={**(profile.profiling or {}), "extended": extended},
        back_to_back={**profile.back_to_back, **add.back_to_back},  # the devices it had keep theirs
    )
