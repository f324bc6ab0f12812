"""nn.Module + example inputs -> the joint forward+backward aten Graph, and binding/unbinding its tensors.

Design: we trace one function, `forward; torch.autograd.grad(outputs, params, tangents)`, with
`make_fx` on fake tensors under a `FunctionalTensorMode`. This is what AOTAutograd does inside, but
done directly so we own the whole joint graph and its bookkeeping: AOTAutograd's partitioner hook
sees the joint graph without the metadata that says which outputs are buffer updates or regenerated
views, and torch.export's joint export needs a scalar loss output. Owning the trace gives us:
- functionalization (BN running stats become outputs; in-place ops on inputs are detected and rejected),
- fake tensors, so data-dependent control flow and shapes fail loudly (we report the user's file:line
  and module path) and capture costs no real compute or memory,
- the traced order of the autograd engine, so random ops run in eager order (dropout reproduces).
The traced FX graph is then lowered to an xsched Graph by xsched.capture.fxgraph (views folded).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch._subclasses.functional_tensor import FunctionalTensor, FunctionalTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils._pytree import tree_flatten

from xsched.capture.blocks import capture_blocks
from xsched.capture.fused_dropout import fused_dropout
from xsched.capture.fxgraph import Slot, TraceInfo, build_graph
from xsched.capture.grad_outputs import GradOutputs, differentiated
from xsched.capture.module_frames import ModuleTracker, compiler_tracing, located
from xsched.capture.reuse import TensorMeta, fake_outputs, fake_state, reuse_or_capture
from xsched.contracts.device_dtypes import typed_for
from xsched.contracts.graph import Graph
from xsched.contracts.torch_ops import resolve_ref, with_device_literals
from xsched.errors import CaptureError, XschedError


@dataclass(frozen=True)
class CapturedOutputs:
    """What one training step of the captured graph produced, in the model's terms."""

    outputs: tuple[torch.Tensor, ...]  # the model's forward outputs (flattened), views applied
    grads: dict[str, torch.Tensor]  # param qualified name -> gradient
    buffers: dict[str, torch.Tensor]  # buffer qualified name -> new value
    input_grads: dict[int, torch.Tensor] = field(default_factory=dict)  # input position -> gradient


def capture(
    model: nn.Module,
    example_inputs: tuple,
    *,
    inference: bool = False,
    name: str | None = None,
    grad_outputs: GradOutputs = "all",
    reuse_blocks: bool = False,
    device_type: str | None = None,
) -> Graph:
    """Trace `model(*example_inputs)` (and its backward unless `inference`) into a Graph.

    Graph inputs: params ("param:<name>"), buffers ("buffer:<name>"), tensor inputs ("input:<i>")
    and, for training, one tangent per differentiated forward output ("tangent:<i>", i its position).
    `grad_outputs` says which outputs the backward differentiates (xsched.capture.grad_outputs): "all" that
    require grad (default), "auto" (the scalar losses if the forward returns any) or their positions; the others
    get no tangent and no backward ops, as `loss.backward()` runs none for the logits beside the loss.
    Outputs: the forward outputs, param (and input) gradients, and updated buffers.
    `reuse_blocks`: where the model's body is a list of enough identical blocks to pay, trace it cut to a few
    blocks and extrapolate (xsched.capture.blocks): the same graph, checked, else the full trace.
    `device_type`: the kind of device whose kernels compute the graph ("cuda" where a GPU runs it; default the
    model's, which the trace's fake kernels follow): the outputs whose dtype the device decides (a layer norm's mean
    and rstd) are typed as it makes them (xsched.contracts.device_dtypes), whatever device the model is on.
    """
    if not isinstance(model, nn.Module):
        raise CaptureError(f"capture needs an nn.Module, got {type(model).__name__}")
    tensors = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
    on = _model_device(model, tensors).type
    target = device_type or on
    cut = lambda m: _capture(m, example_inputs, inference, name, grad_outputs)  # noqa: E731
    whole = lambda: cut(model)  # noqa: E731
    blocks = lambda: capture_blocks(model, tensors, inference, cut, whole)  # noqa: E731
    traced = blocks if reuse_blocks else whole

    on_host_for_gpu = target == "cuda" and on == "cpu"

    def trace() -> Graph:
        # dropout as the target's kernels run it (a GPU's fused kernel)
        with fused_dropout(target), _lstm_per_step(not inference or target != "cpu"):
            graph = traced()
        return _devices_named(graph, "cuda:0") if on_host_for_gpu else graph  # as from the GPU's tensors

    try:  # within `captured_once()`, a repeat of a capture returns its graph
        graph = reuse_or_capture(
            model, example_inputs, inference, grad_outputs, name or type(model).__name__, trace, target
        )
    except CaptureError as e:  # one line that names the model (and the library model inside a loss wrapper)
        raise CaptureError(f"{model_label(model)}: {e.detail}", op=e.op, value=e.value) from e
    return typed_for(graph, target)


@contextlib.contextmanager
def _lstm_per_step(on: bool) -> Iterator[None]:
    """torch's LSTM decomposition takes oneDNN's fused layer on a CPU. Its fake kernel sizes the workspace that its
    backward reads as empty (a real one holds every step's gates), and no GPU runs it. So in training, or for a
    GPU, the LSTM is traced as its per-step ops, which every device runs and whose sizes are exact."""
    before = torch.backends.mkldnn.enabled
    torch.backends.mkldnn.enabled = before and not on  # what the decomposition reads (`use_mkldnn`)
    try:
        yield
    finally:
        torch.backends.mkldnn.enabled = before


def _devices_named(graph: Graph, device: str) -> Graph:
    """`graph` with its ops' device literals (`torch.arange(T, device=x.device)`) naming `device`. The run device
    replaces them when an op runs, so they only make the fingerprint: a capture for a GPU from CPU tensors then
    fingerprints as one from the GPU's, and the profiles and plans made for either serve both."""
    ops = tuple(
        dataclasses.replace(op, call=with_device_literals(dict(op.call), device)) if op.call else op for op in graph.ops
    )
    return dataclasses.replace(graph, ops=ops)


def model_label(model: nn.Module) -> str:
    """The model's class, and that of the first library model inside it with a config (a Hugging Face model under
    a loss wrapper): `OwnLoss (LlamaForCausalLM)`."""
    outer = type(model).__name__
    inner = next((type(m).__name__ for m in model.modules() if hasattr(getattr(m, "config", None), "model_type")), None)
    return f"{outer} ({inner})" if inner and inner != outer else outer


def _capture(
    model: nn.Module, example_inputs: tuple, inference: bool, name: str | None, grad_outputs: GradOutputs
) -> Graph:
    if not isinstance(example_inputs, tuple):
        example_inputs = (example_inputs,)
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    input_pos = [i for i, x in enumerate(example_inputs) if isinstance(x, torch.Tensor)]
    modules = ModuleTracker(model)
    out_meta = _forward_outputs(model, params, buffers, example_inputs, modules)
    wants_grad = [False] * len(out_meta)
    if not inference:
        wants_grad = list(
            differentiated(grad_outputs, [m.differentiable for m in out_meta], [not m.shape for m in out_meta])
        )
    grad_params = [] if inference else [k for k, p in params.items() if p.requires_grad]
    grad_inputs = [] if inference else [i for i in input_pos if example_inputs[i].requires_grad]
    slots = (
        [Slot("param", k, f"param:{k}") for k in params]
        + [Slot("buffer", k, f"buffer:{k}") for k in buffers]
        + [Slot("input", str(i), f"input:{i}") for i in input_pos]
        + [Slot("tangent", str(i), f"tangent:{i}") for i, w in enumerate(wants_grad) if w]
    )
    n_param, n_buf, n_in = len(params), len(buffers), len(input_pos)
    record: dict[str, Any] = {}

    def joint(*flat: torch.Tensor) -> list[torch.Tensor]:
        ps, bs = flat[:n_param], flat[n_param : n_param + n_buf]
        xs, ts = flat[n_param + n_buf : n_param + n_buf + n_in], flat[n_param + n_buf + n_in :]
        args = list(example_inputs)
        for i, x in zip(input_pos, xs):
            args[i] = x
        state = {**dict(zip(params, ps)), **dict(zip(buffers, bs))}
        # the traced tensors stay swapped in through backward too: activation checkpointing re-runs the
        # forward there and must see them, not the real parameters
        with _reparametrize_module(model, state, tie_weights=True):
            with torch.enable_grad() if not inference else torch.no_grad():
                outs = _tensor_leaves(model(*args))
            record["forward_nodes"] = modules.graph_len()  # nodes traced before backward starts
            diff = [o for o, w in zip(outs, wants_grad) if w]
            wrt = [ps[list(params).index(k)] for k in grad_params] + [xs[input_pos.index(i)] for i in grad_inputs]
            grads = torch.autograd.grad(diff, wrt, list(ts), allow_unused=True) if diff and wrt else [None] * len(wrt)
        record["grads"] = [g is not None for g in grads]
        return [*outs, *(g for g in grads if g is not None), *bs]

    gm, mutated = _trace(
        joint,
        [*params.values(), *buffers.values(), *(example_inputs[i] for i in input_pos)],
        [torch.empty(m.shape, dtype=m.dtype, device=m.device) for m, w in zip(out_meta, wants_grad) if w],
        inference,
        modules,
    )
    _reject_mutations(mutated, [f"param {k}" for k in params], [f"input input:{i}" for i in input_pos], n_buf)
    grad_names = [f"param:{k}" for k in grad_params] + [f"input:{i}" for i in grad_inputs]
    got = [nm for nm, ok in zip(grad_names, record["grads"]) if ok]
    n_out = len(out_meta)
    info = TraceInfo(
        slots=tuple(slots),
        n_outputs=n_out,
        grad_of=tuple(got),
        updates=tuple(f"buffer:{k}" for k, m in zip(buffers, mutated[n_param : n_param + n_buf]) if m),
        update_positions=tuple(n_out + len(got) + j for j, m in enumerate(mutated[n_param : n_param + n_buf]) if m),
        node_module=modules.node_module,
        inference=inference,
        training=model.training,
        input_requires_grad={i: bool(example_inputs[i].requires_grad) for i in input_pos},
        unused_grads=tuple(nm for nm, ok in zip(grad_names, record["grads"]) if not ok),
        forward_nodes=record["forward_nodes"],
    )
    graph = build_graph(gm, info, name or type(model).__name__)
    return dataclasses.replace(graph, extra={**graph.extra, "model": model_label(model)})  # the training roles kept


def _model_device(model: nn.Module, inputs: tuple) -> torch.device:
    """Where the forward outputs, and so their default tangents, live: the first parameter's, buffer's or
    input's device (a CPU tangent for a GPU model would be copied to the GPU at every run)."""
    tensors = (*model.parameters(), *model.buffers(), *(x for x in inputs if isinstance(x, torch.Tensor)))
    return next((t.device for t in tensors), torch.device("cpu"))


def bind_inputs(
    graph: Graph, model: nn.Module, inputs: tuple, tangents: tuple | None = None
) -> dict[str, torch.Tensor]:
    """Value id -> tensor for every graph input. Tangents are indexed by forward-output position
    (or given in tangent order); None means ones, as `loss.backward()` would use, on the model's device."""
    if not isinstance(inputs, tuple):
        inputs = (inputs,)
    home = _model_device(model, inputs)
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    n_out = len(graph.forward_outputs or ())
    tangent_vals = [graph.value[v] for v in graph.inputs if graph.value[v].kind == "tangent"]
    env: dict[str, torch.Tensor] = {}
    for vid in graph.inputs:
        v = graph.value[vid]
        name = v.name or ""
        if v.kind == "param" and name in params:
            env[vid] = params[name].detach()
        elif v.kind == "buffer" and name in buffers:
            env[vid] = buffers[name].detach()
        elif v.kind == "input" and name.startswith("input:") and int(name[6:]) < len(inputs):
            env[vid] = inputs[int(name[6:])].detach()
        elif v.kind == "tangent":
            pos = int(name.split(":")[1])
            if tangents is None:
                env[vid] = torch.ones(v.shape or (), dtype=getattr(torch, v.dtype or "float32"), device=home)
            elif len(tangents) == n_out:
                env[vid] = tangents[pos]
            elif len(tangents) == len(tangent_vals):
                env[vid] = tangents[tangent_vals.index(v)]
            else:
                raise CaptureError(
                    f"got {len(tangents)} tangents; expected {n_out} (one per output) or {len(tangent_vals)}", value=vid
                )
        else:
            raise CaptureError(f"cannot bind graph input {name!r}: the model or the inputs do not have it", value=vid)
        if v.shape is not None and tuple(env[vid].shape) != tuple(v.shape):
            raise CaptureError(f"{name} has shape {list(env[vid].shape)}, the graph expects {list(v.shape)}", value=vid)
    return env


def unpack_outputs(graph: Graph, values: Mapping[str, torch.Tensor]) -> CapturedOutputs:
    """The model-level view of a run's outputs: forward outputs, grads by param name, new buffers."""
    g = graph  # the training roles: what the model's forward returns and backward fills
    try:
        return CapturedOutputs(
            outputs=tuple(resolve_ref(r, values) for r in g.forward_outputs or ()),
            grads={k: resolve_ref(r, values) for k, r in (g.grads or {}).items()},
            buffers={k: resolve_ref(r, values) for k, r in (g.buffer_updates or {}).items()},
            input_grads={k: resolve_ref(r, values) for k, r in (g.input_grads or {}).items()},
        )
    except XschedError as e:
        raise XschedError(f"graph output missing from the run: {e.detail}", stage="execute", value=e.value) from e


# ---- tracing ----
def _reject_mutations(mutated: list[bool], params: list[str], inputs: list[str], n_buffers: int) -> None:
    """In-place updates are fine on buffers (they become outputs); on params or inputs they are an error."""
    flags = mutated[: len(params)] + mutated[len(params) + n_buffers :]
    for what, hit in zip(params + inputs, flags):
        if hit:
            raise CaptureError(f"the model mutates {what} in place; capture supports in-place updates of buffers only")


def _tensor_leaves(out: Any) -> list[torch.Tensor]:
    leaves = [x for x in tree_flatten(out)[0] if isinstance(x, torch.Tensor)]
    _reject_complex([t.dtype for t in leaves])
    return leaves


def _reject_complex(dtypes: list[torch.dtype]) -> None:
    """A CaptureError naming the first complex forward output, if any."""
    for k, dtype in enumerate(dtypes):
        if dtype.is_complex:
            raise CaptureError(f"forward output {k} is complex; complex outputs are not supported")


def _forward_outputs(
    model: nn.Module, params: dict, buffers: dict, inputs: tuple, modules: ModuleTracker
) -> list[TensorMeta]:
    """The forward's tensor outputs (the tangents' shapes), found by one forward on fake tensors (or the capture
    scope's earlier one)."""

    def forward() -> Any:
        with FakeTensorMode(allow_non_fake_inputs=False) as mode, modules.active():
            state, args = fake_state(mode, [*params.items(), *buffers.items()], inputs)
            with located(modules):
                return torch.func.functional_call(model, state, args)

    outs = fake_outputs(model, inputs, forward).tensors
    _reject_complex([t.dtype for t in outs])
    return outs


def _trace(
    joint: Callable[..., list[torch.Tensor]],
    primals: list[torch.Tensor],
    tangents: list[torch.Tensor],
    inference: bool,
    modules: ModuleTracker,
) -> tuple[torch.fx.GraphModule, list[bool]]:
    """make_fx of `joint` under functionalization; also which primals it mutated in place."""
    mutated: list[bool] = []

    def functional(*flat: torch.Tensor) -> list[torch.Tensor]:
        with FunctionalTensorMode():
            wrapped = [FunctionalTensor.to_functional(t) for t in flat]
            outs = joint(*wrapped)
            for t in outs:
                torch._sync(t)
            for t in wrapped[: len(primals)]:
                torch._sync(t)
                if torch._functionalize_has_metadata_mutation(t.elem):
                    raise CaptureError("the model changes the shape or strides of an input in place")
                mutated.append(torch._functionalize_has_data_mutation(t.elem))
        return [torch._from_functional_tensor(t.elem) for t in outs]

    flat = [p.detach().requires_grad_(p.requires_grad and not inference) for p in primals] + tangents
    with modules.active(), located(modules), compiler_tracing():
        gm = make_fx(functional, tracing_mode="fake")(*flat)
    return gm, mutated
