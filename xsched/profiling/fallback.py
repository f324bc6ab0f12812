"""Costs of the ops profiling did not measure within its time cap: a roofline of what the device reached.

An op with the signature of a measured op has its cost (they are one group). Any other op on device d costs
    time = L + max(flops / F, bytes / B)
where F is the median FLOP rate d reached on the NEAREST measured ops with FLOPs (matmul-like) closest in FLOPs,
B the median byte rate (inputs + outputs) of the NEAREST other measured ops closest in bytes, and L the time of
its fastest measured op (launch overhead); energy at the measured ops' median power; workspace none but a
stand-in's (devices/stand_in.py). A rate no measured op shows (no op with FLOPs measured yet, say) is the
one of d's spec (simulated devices, real ones a spec matches), else profiling.model's for d's kind. The profile
lists these ops in extra["modelled_ops"][d]. rounds.py uses the same roofline for the time an op not yet measured
will take to measure.
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections.abc import Mapping, Sequence

from xsched.contracts.graph import Graph, Op
from xsched.contracts.profile import OpCost
from xsched.devices.base import Device
from xsched.devices.sim import op_dtype, op_flops, op_io_bytes
from xsched.devices.spec import DeviceSpec
from xsched.devices.stand_in import op_stand_in_workspace
from xsched.profiling.model import MODEL_BANDWIDTH, MODEL_FLOPS, MODEL_LATENCY_S, model_kind

NEAREST = 3  # an unmeasured op's rates: the median of this many measured ops nearest in size

FALLBACK_RULE = (
    "ops not measured within max_total_s: L + max(flops / F, bytes / B), F and B the rates the device reached "
    "on its measured ops of the nearest sizes (xsched/profiling/fallback.py); listed in extra['modelled_ops']"
)


def flops_of(graph: Graph, op: Op) -> float:
    """FLOPs of one call (torch's counter on meta tensors); 0 for an op that cannot be run or counted."""
    try:
        return op_flops(graph, op)
    except Exception:  # cost-only graphs and ops torch cannot count: bandwidth only
        return 0.0


class _NearestRates:
    """Rates (per second) of measured ops by their size (FLOPs or bytes): an op's rate is the median of the
    NEAREST measured ones closest in size on a log scale, as caches make small ops faster per byte than large ones."""

    def __init__(self, points: Sequence[tuple[float, float]]) -> None:
        pts = sorted((math.log(size), rate) for size, rate in points if size > 0 and rate > 0)
        self.logs, self.rates = [x for x, _ in pts], [r for _, r in pts]

    def __bool__(self) -> bool:
        return bool(self.rates)

    def at(self, size: float) -> float:
        x = math.log(size)
        i = bisect.bisect_left(self.logs, x)
        window = range(max(0, i - NEAREST), min(len(self.logs), i + NEAREST))
        near = sorted(window, key=lambda j: abs(self.logs[j] - x))[:NEAREST]
        return statistics.median(self.rates[j] for j in near)


class Roofline:
    """The roofline of what `device` reached on its measured ops (`measured`: op id -> cost there); a rate it has
    no measurement for comes from its spec, else from profiling.model's guess for its kind."""

    def __init__(self, graph: Graph, device: Device, measured: Mapping[str, OpCost]) -> None:
        self.graph = graph
        sizes = [(flops_of(graph, graph.op[o]), op_io_bytes(graph, graph.op[o]), c) for o, c in measured.items()]
        sizes = [(f, b, c) for f, b, c in sizes if c.time_s > 0]
        spec = getattr(device, "spec", None)
        self.spec = spec if isinstance(spec, DeviceSpec) else None
        self.kind = model_kind(device.name)
        self.kernels = "cuda" if self.spec is not None and self.spec.kind == "gpu" else self.kind  # whose kernels run
        # matmul-like ops (FLOPs counted) set the FLOP rates, the others the byte rates (a matmul's bytes per second
        # say little of the memory); typical rates of ops of the size, not the best: some ops touch less than their
        # inputs and outputs (a loss reads one logit per row)
        self.flop_rates = _NearestRates([(f, f / c.time_s) for f, _, c in sizes if f > 0])
        self.byte_rates = _NearestRates([(b, b / c.time_s) for f, b, c in sizes if f == 0]) or _NearestRates(
            [(b, b / c.time_s) for _, b, c in sizes]
        )
        self.latency = min(
            (c.time_s for *_, c in sizes), default=self.spec.launch_overhead_s if self.spec else MODEL_LATENCY_S
        )
        self.power = statistics.median(c.energy_j / c.time_s for *_, c in sizes) if sizes else 0.0

    def time_s(self, op_id: str) -> float:
        op = self.graph.op[op_id]
        flops, nbytes = flops_of(self.graph, op), op_io_bytes(self.graph, op)
        if not flops:
            flop_s = 0.0
        elif self.flop_rates:
            flop_s = flops / self.flop_rates.at(flops)
        else:
            flop_s = flops / (self.spec.peak(op_dtype(self.graph, op)) if self.spec else MODEL_FLOPS[self.kind])
        if not nbytes:
            byte_s = 0.0
        elif self.byte_rates:
            byte_s = nbytes / self.byte_rates.at(nbytes)
        else:
            byte_s = nbytes / (self.spec.memory_bandwidth if self.spec else MODEL_BANDWIDTH[self.kind])
        return self.latency + max(flop_s, byte_s)

    def cost(self, op_id: str) -> OpCost:
        t = self.time_s(op_id)
        return OpCost(t, self.power * t, op_stand_in_workspace(self.graph, self.graph.op[op_id], self.kernels))


def roofline_costs(
    graph: Graph, device: Device, measured: Mapping[str, OpCost], missing: Sequence[str]
) -> dict[str, OpCost]:
    """Per op id of `missing`, its modelled cost on `device`, from `measured` (op id -> measured cost there)."""
    model = Roofline(graph, device, measured)
    return {o: model.cost(o) for o in missing}
