"""Simulated devices: an analytic roofline from a TOML spec in xsched/devices/specs/ (peak FLOP/s, bandwidths, power).

Op time   = max(flops / peak_flops[dtype], bytes / memory_bandwidth) + launch_overhead_s, where flops come
            from torch's FlopCounterMode running the op on meta tensors and bytes are the op's output nbytes
            and, of each input, what the op reads of it: the bytes its views expose (a row block of the
            logits, not all of them), or the rows an index picks (nll_loss, embedding), at most its nbytes;
            and again, what an op's kernels read or write a second time (masked_fill's clone, filled in
            place; layer norm backward's weight gradients).
            A dtype the spec does not list runs at its float32 rate.
Op energy = (idle_power_w + (max_power_w - idle_power_w) * u) * time, u = roofline time / total time
            (the fraction of the op's time the device is busy rather than waiting on the launch).
Copies    = latency_s + nbytes / bandwidth over the spec's host [link] (pageable_bandwidth for pageable
            host memory), its [peer] link between two instances of one GPU spec, or both host links in
            turn between two different simulated GPUs.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from xsched.contracts.graph import Graph, Op
from xsched.contracts.profile import DeviceInfo
from xsched.devices.base import DEFAULT_POLICY, Device, DeviceError, DeviceInfoRow, Measurement, Policy
from xsched.devices.energy import modelled_energy
from xsched.devices.spec import DeviceSpec, all_specs, sim_spec
from xsched.devices.stand_in import op_stand_in_workspace

MODEL_VERSION = "roofline/4"  # part of every sim fingerprint: bump when the formulas above change


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
    """The bytes one call of `op` moves: its outputs, and of each input what the op reads of it; for an op whose
    kernels pass over some of them more than once (`SECOND_PASSES`), those bytes again."""
    read = _read_bytes(graph, op)
    inputs = sum(read.get(v, graph.value[v].nbytes) for v in dict.fromkeys(op.inputs))
    once = inputs + sum(graph.value[v].nbytes for v in dict.fromkeys(op.outputs) if v not in op.inputs)
    again = SECOND_PASSES.get(op.target)
    return once + (again(graph, op, read) if again is not None and op.call else 0)


def _filled_clone(graph: Graph, op: Op, read: dict[str, int]) -> int:
    """masked_fill (out of place) is ATen's clone of `self`, then masked_fill_ on the clone: the fill reads and
    writes the output again."""
    return 2 * sum(graph.value[v].nbytes for v in dict.fromkeys(op.outputs))


def _gamma_beta_again(graph: Graph, op: Op, read: dict[str, int]) -> int:
    """native_layer_norm_backward's weight and bias gradients come from a second kernel (CUDA's GammaBetaBackward,
    the CPU's second loop), which reads the output's gradient and the input again."""
    args = op.call.get("args", [])
    mask = args[7] if len(args) > 7 and isinstance(args[7], list) else [True, True, True]
    if not (mask[1] or mask[2]):
        return 0
    refs = [a["ref"] for a in args[:2] if isinstance(a, dict) and "ref" in a]
    return sum(read.get(v, graph.value[v].nbytes) for v in refs)


# ops whose kernels pass over some bytes twice: target -> (graph, op, bytes read in part) -> the bytes moved again
SECOND_PASSES: dict[str, Callable[[Graph, Op, dict[str, int]], int]] = {
    "aten.masked_fill.Scalar": _filled_clone,
    "aten.masked_fill.Tensor": _filled_clone,
    "aten.native_layer_norm_backward.default": _gamma_beta_again,
}


_READ: dict[tuple[str, str], dict[str, int]] = {}  # (graph fingerprint, op id) -> bytes read of inputs read in part


def _picked_rows(args: list) -> dict[int, int]:
    """nll_loss_forward(self, target, ...) reads one element of `self` per target: arg 0's bytes."""
    return {0: args[1].numel() * args[0].element_size()}


def _shape_only(position: int) -> Callable[[list], dict[int, int]]:
    """An argument the kernel takes for its shape alone (nll_loss_backward's `self`): none of its bytes."""
    return lambda args: {position: 0}


def _looked_up_rows(args: list) -> dict[int, int]:
    """embedding(weight, indices) reads one row of `weight` per index: arg 0's bytes."""
    return {0: args[1].numel() * args[0].shape[-1] * args[0].element_size()}


# ops that read only part of an argument whatever its views: target -> (its decoded args -> position -> bytes read)
PARTIAL_READS: dict[str, Callable[[list], dict[int, int]]] = {
    "aten.nll_loss_forward.default": _picked_rows,
    "aten.nll_loss2d_forward.default": _picked_rows,
    "aten.nll_loss_backward.default": _shape_only(1),
    "aten.nll_loss2d_backward.default": _shape_only(1),
    "aten.embedding.default": _looked_up_rows,
}


def _read_bytes(graph: Graph, op: Op) -> dict[str, int]:
    """For each input the op reads only in part, the bytes it reads (at most its nbytes): through views, the bytes
    the views expose (numel x item size, on meta tensors; an expanded view reads no more than its base), summed
    over its refs; by the op's nature, `PARTIAL_READS`. An input also read whole is left out (all of it counts)."""
    from xsched.contracts import torch_ops as ops

    if not op.call or not ops.is_executable(op):
        return {}
    refs = list(ops.iter_refs(op.call))
    viewed = {r["ref"] for r in refs if r.get("view")} - {r["ref"] for r in refs if not r.get("view")}
    rule = PARTIAL_READS.get(op.target)
    if not viewed and rule is None:
        return {}
    key = (graph.fingerprint, op.id)
    if key not in _READ:
        if len(_READ) > 1_000_000:
            _READ.clear()
        env = ops.op_input_tensors(graph, op, "meta")
        read = dict.fromkeys(viewed, 0)
        for r in refs:
            if r["ref"] in read:
                t = ops.resolve_ref(r, env)
                if isinstance(t, torch.Tensor):
                    read[r["ref"]] += t.numel() * t.element_size()
                else:  # a view chain ending in something else: count the whole input
                    del read[r["ref"]]
        if rule is not None:
            args = op.call.get("args", [])
            once = {v for v in (r["ref"] for r in refs) if sum(r["ref"] == v for r in refs) == 1}
            for k, nbytes in rule(ops.decode(list(args), env, torch.device("meta"))).items():
                if isinstance(args[k], dict) and args[k].get("ref") in once:
                    read[args[k]["ref"]] = nbytes
        _READ[key] = {v: min(b, graph.value[v].nbytes) for v, b in read.items()}
    return _READ[key]


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
        self.spec = sim_spec(name)
        self.instance = int(name.partition("#")[2] or 0)

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
