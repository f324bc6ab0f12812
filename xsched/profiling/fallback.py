"""Costs of the ops profiling did not measure within its time cap: a roofline of what the device reached.

An op with the signature of a measured op has its cost (they are one group). Any other op on device d costs
    time = L + max(flops / F, bytes / B)
where F and B are the fastest FLOP rate and byte rate (inputs + outputs) d reached on its measured ops and L the
time of its fastest measured op (launch overhead); energy at the measured ops' median power, no workspace. Without
any measured op, the roofline of d's spec (simulated devices, real ones a spec matches), else profiling.model's
bytes over the kind's bandwidth. The profile lists these ops in extra["modelled_ops"][d].
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence

from xsched.contracts.graph import Graph, Op
from xsched.contracts.profile import OpCost
from xsched.devices.base import Device
from xsched.devices.sim import DeviceSpec, op_dtype, op_flops, op_io_bytes, roofline
from xsched.profiling.model import modelled_op_seconds

FALLBACK_RULE = (
    "ops not measured within max_total_s: L + max(flops / F, bytes / B) from the fastest rates the device reached "
    "on its measured ops (xsched/profiling/fallback.py); listed in extra['modelled_ops']"
)


def flops_of(graph: Graph, op: Op) -> float:
    """FLOPs of one call (torch's counter on meta tensors); 0 for an op that cannot be run or counted."""
    try:
        return op_flops(graph, op)
    except Exception:  # cost-only graphs and ops torch cannot count: bandwidth only
        return 0.0


class Roofline:
    """The roofline of what `device` reached on its measured ops (`measured`: op id -> cost there)."""

    def __init__(self, graph: Graph, device: Device, measured: Mapping[str, OpCost]) -> None:
        self.graph, self.device = graph, device
        rates = [(flops_of(graph, graph.op[o]), op_io_bytes(graph, graph.op[o]), c) for o, c in measured.items()]
        rates = [(f, b, c) for f, b, c in rates if c.time_s > 0]
        self.measured = bool(rates)
        self.flop_rate = max((f / c.time_s for f, _, c in rates if f > 0), default=math.inf)
        self.byte_rate = max((b / c.time_s for _, b, c in rates if b > 0), default=math.inf)
        self.latency = min((c.time_s for *_, c in rates), default=0.0)
        self.power = statistics.median(c.energy_j / c.time_s for *_, c in rates) if rates else 0.0

    def time_s(self, op_id: str) -> float:
        op = self.graph.op[op_id]
        if self.measured:
            return self.latency + max(
                flops_of(self.graph, op) / self.flop_rate, op_io_bytes(self.graph, op) / self.byte_rate
            )
        spec = getattr(self.device, "spec", None)
        if isinstance(spec, DeviceSpec):
            return roofline(spec, flops_of(self.graph, op), op_io_bytes(self.graph, op), op_dtype(self.graph, op))[0]
        return modelled_op_seconds(self.graph, op_id, self.device.name)

    def cost(self, op_id: str) -> OpCost:
        t = self.time_s(op_id)
        return OpCost(t, self.power * t, 0)


def roofline_costs(
    graph: Graph, device: Device, measured: Mapping[str, OpCost], missing: Sequence[str]
) -> dict[str, OpCost]:
    """Per op id of `missing`, its modelled cost on `device`, from `measured` (op id -> measured cost there)."""
    model = Roofline(graph, device, measured)
    return {o: model.cost(o) for o in missing}
