"""The workspace of an op's stand-in on a device without its kernel (contracts/device_kernels), for the cost
models that price ops without measuring them and have torch loaded: simulated devices and the fallback for ops a
measured profile skipped. (The modelled profile, `profiling/model.py`, must not import torch, and prices none.)"""

from __future__ import annotations

from xsched.contracts.graph import Graph, Op


def op_stand_in_workspace(graph: Graph, op: Op, device_type: str) -> int:
    """What `op`'s stand-in allocates beside its inputs and outputs where `device_type` lacks its kernel (a bound,
    from its arguments as meta tensors); 0 for every other op, and where the device has the kernel."""
    if op.call is None:  # a cost-only graph (an imported file) runs nothing: planning it never imports torch
        return 0
    import torch

    from xsched.contracts import torch_ops as ops
    from xsched.contracts.device_kernels import DEVICE_KERNELS, stand_in_workspace

    if op.target not in DEVICE_KERNELS or not ops.is_executable(op):
        return 0
    env, meta = ops.op_input_tensors(graph, op, "meta"), torch.device("meta")
    args = ops.decode(list(op.call.get("args", [])), env, meta)
    kwargs = {k: ops.decode(v, env, meta) for k, v in op.call.get("kwargs", {}).items()}
    return stand_in_workspace(op.target, device_type, args, kwargs)
