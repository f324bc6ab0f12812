"""Costs of the ops profiling did not measure within its time cap: a roofline of what the device reached.

An op with the signature of a measured op has its cost (they are one group). Any other op on device d costs
    time = L + max(flops / F, bytes / B)
where F is the median FLOP rate d reached on its measured ops with FLOPs (matmul-like), B the median byte rate
(inputs + outputs) on the others, and L the time of its fastest measured op (launch overhead); energy at the
measured ops' median power, no workspace. A rate no measured op shows (no op with FLOPs measured yet, say) is the
one of d's spec (simulated devices, real ones a spec matches), else profiling.model's for d's kind. The profile
lists these ops in extra["modelled_ops"][d]. rounds.py uses the same roofline for the time an op not yet measured
will take to measure.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence

from xsched.contracts.graph import Graph, Op
from xsched.contracts.profile import OpCost
from xsched.devices.base import Device
from xsched.devices.sim import DeviceSpec, op_dtype, op_flops, op_io_bytes
from xsched.profiling.model import MODEL_BANDWIDTH, MODEL_FLOPS, MODEL_LATENCY_S, model_kind

FALLBACK_RULE = (
    "ops not measured within max_total_s: L + max(flops / F, bytes / B) from the median rates the device reached "
    "on its measured ops (xsched/profiling/fallback.py); listed in extra['modelled_ops']"
)


def flops_of(graph: Graph, op: Op) -> float:
    """FLOPs of one call (torch's counter on meta tensors); 0 for an op that cannot be run or counted."""
    try:
        return op_flops(graph, op)
    except Exception:  # cost-only graphs and ops torch cannot count: bandwidth only
        return 0.0


class Roofline:
    """The roofline of what `device` reached on its measured ops (`measured`: op id -> cost there); a rate it has
    no measurement for comes from its spec, else from profiling.model's guess for its kind."""

    def __init__(self, graph: Graph, device: Device, measured: Mapping[str, OpCost]) -> None:
        self.graph = graph
        rates = [(flops_of(graph, graph.op[o]), op_io_bytes(graph, graph.op[o]), c) for o, c in measured.items()]
        rates = [(f, b, c) for f, b, c in rates if c.time_s > 0]
        spec = getattr(device, "spec", None)
        self.spec = spec if isinstance(spec, DeviceSpec) else None
        self.kind = kind = model_kind(device.name)
        # typical rates, not the best: some ops touch less than their inputs and outputs (a loss reads one logit
        # per row) or compute less than the FLOP count says; matmul-like ops (FLOPs counted) set F, the others B
        flop_rates = [f / c.time_s for f, _, c in rates if f > 0]
        byte_rates = [b / c.time_s for f, b, c in rates if b > 0 and f == 0] or [
            b / c.time_s for _, b, c in rates if b > 0
        ]
        self.flop_rate = statistics.median(flop_rates) if flop_rates else None  # None: by dtype, in time_s
        if byte_rates:
            self.byte_rate = statistics.median(byte_rates)
        else:
            self.byte_rate = self.spec.memory_bandwidth if self.spec else MODEL_BANDWIDTH[kind]
        self.latency = min(
            (c.time_s for *_, c in rates), default=self.spec.launch_overhead_s if self.spec else MODEL_LATENCY_S
        )
        self.power = statistics.median(c.energy_j / c.time_s for *_, c in rates) if rates else 0.0

    def time_s(self, op_id: str) -> float:
        op = self.graph.op[op_id]
        flop_rate = self.flop_rate
        if flop_rate is None:
            flop_rate = self.spec.peak(op_dtype(self.graph, op)) if self.spec else MODEL_FLOPS[self.kind]
        return self.latency + max(flops_of(self.graph, op) / flop_rate, op_io_bytes(self.graph, op) / self.byte_rate)

    def cost(self, op_id: str) -> OpCost:
        t = self.time_s(op_id)
        return OpCost(t, self.power * t, 0)


def roofline_costs(
    graph: Graph, device: Device, measured: Mapping[str, OpCost], missing: Sequence[str]
) -> dict[str, OpCost]:
    """Per op id of `missing`, its modelled cost on `device`, from `measured` (op id -> measured cost there)."""
    model = Roofline(graph, device, measured)
    return {o: model.cost(o) for o in missing}
