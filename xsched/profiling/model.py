"""The modelled profile: costs from bytes over bandwidth, for planning before (or without) measuring."""

from __future__ import annotations

from collections.abc import Sequence

from xsched.contracts.graph import Graph
from xsched.contracts.profile import DeviceInfo, LinkCost, OpCost, Profile


def cost_profile(graph: Graph, devices: Sequence[str]) -> Profile:
    """A modelled profile (no measurement): each op costs the bytes it touches over the device's bandwidth,
    each copy a latency plus bytes over the link's bandwidth. Labelled "model" for energy (none is modelled)."""
    kinds = {d: "cuda" if d.startswith(("cuda", "ort:cuda")) else "cpu" for d in devices}  # ONNX Runtime's too
    bandwidth = {"cpu": 2e10, "cuda": 1e12}
    compute = {d: {o.id: OpCost(2e-6 + graph.op_bytes(o.id) / bandwidth[kinds[d]]) for o in graph.ops} for d in devices}
    copy = {
        f"{a}->{b}": LinkCost(1e-5, 1.2e10 if "cuda" in (kinds[a], kinds[b]) else 1e10)
        for a in devices
        for b in devices
        if a != b
    }
    info = {d: DeviceInfo(kinds[d]) for d in devices}
    return Profile(graph.fingerprint, info, compute, copy, dict.fromkeys(devices, "model"), {"modelled": True})
