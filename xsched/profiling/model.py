"""The modelled profile: costs from bytes over bandwidth, for planning before (or without) measuring."""

from __future__ import annotations

from collections.abc import Sequence

from xsched.contracts.graph import Graph
from xsched.contracts.profile import DeviceInfo, LinkCost, OpCost, Profile, check_device_roles

MODEL_BANDWIDTH = {"cpu": 2e10, "cuda": 1e12}  # bytes/s an op's inputs and outputs move at, per device kind
MODEL_LATENCY_S = 2e-6  # per op
# float32 FLOP/s for a device of the kind when nothing measured says better (profiling's fallback): on the low side,
# one CPU core's and a small GPU's, so that a time estimate built on it errs long
MODEL_FLOPS = {"cpu": 1e10, "cuda": 1e13}


def model_kind(device: str) -> str:
    """'cuda' for a GPU name (ONNX Runtime's too), else 'cpu'."""
    return "cuda" if device.startswith(("cuda", "ort:cuda")) else "cpu"


def modelled_op_seconds(graph: Graph, op: str, device: str) -> float:
    """The bytes `op` touches over the bandwidth of `device`'s kind, plus a launch latency."""
    return MODEL_LATENCY_S + graph.op_bytes(op) / MODEL_BANDWIDTH[model_kind(device)]


def cost_profile(graph: Graph, devices: Sequence[str], stores: Sequence[str] = ()) -> Profile:
    """A modelled profile (no measurement): each op costs the bytes it touches over the device's bandwidth,
    each copy a latency plus bytes over the link's bandwidth. Labelled "model" for energy (none is modelled).
    `stores` run no op (no compute entries) and are linked both ways with every device."""
    check_device_roles(devices, stores)
    names = [*devices, *stores]
    kinds = {d: model_kind(d) for d in names}
    compute = {d: {o.id: OpCost(modelled_op_seconds(graph, o.id, d)) for o in graph.ops} for d in devices}
    compute.update({s: {} for s in stores})
    copy = {
        f"{a}->{b}": LinkCost(1e-5, 1.2e10 if "cuda" in (kinds[a], kinds[b]) else 1e10)
        for a in names
        for b in names
        if a != b and not (a in stores and b in stores)
    }
    info = {d: DeviceInfo(kinds[d]) for d in names}
    return Profile(
        graph.fingerprint, info, compute, copy, dict.fromkeys(names, "model"), stores=tuple(stores), modelled=True
    )
