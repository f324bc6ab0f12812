"""A wrapped call's signature: its arguments in the forward's order, the key its plan is kept under (its inputs'
shapes and dtypes, the autocast), their description in errors, and the structure of the call's outputs."""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import TreeSpec

from xsched.capture.reuse import TensorMeta, autocast_state, fake_outputs, fake_state
from xsched.errors import XschedError

_BY_POSITION = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
GRADED_MODES = ("train", "eval-grad")  # a call's modes whose graph has a backward, run through autograd
TENSOR = object()  # where an output's leaf is a tensor (None is a leaf a forward may return: `return out, None`)


def positional(model: nn.Module, args: tuple, kwargs: Mapping[str, Any]) -> tuple:
    """The call's arguments in the order of `model.forward`'s parameters, as a graph's inputs are: a keyword takes
    its parameter's place, the defaults of parameters before the last one given fill the gaps. A call eager would
    refuse raises TypeError as eager does; a keyword-only parameter or one of `**kwargs` is a one-line error."""
    if not kwargs:
        return args
    sig = inspect.signature(model.forward)
    bound = sig.bind(*args, **kwargs)
    named = [p for p in sig.parameters.values() if p.kind in _BY_POSITION]
    for name, value in bound.arguments.items():
        kind = sig.parameters[name].kind
        if kind in (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.VAR_KEYWORD):
            given = next(iter(value)) if kind == inspect.Parameter.VAR_KEYWORD else name
            raise XschedError(
                f"{type(model).__name__}.forward takes {given!r} by keyword only; wrap passes a call's arguments by "
                "position: give it a parameter that can be positional",
                stage="execute",
            )
    last = max((k for k, p in enumerate(named) if p.name in bound.arguments), default=-1)
    out = [bound.arguments.get(p.name, p.default) for p in named[: last + 1]]
    var = next((p.name for p in sig.parameters.values() if p.kind == inspect.Parameter.VAR_POSITIONAL), None)
    return (*out, *bound.arguments.get(var, ())) if var else tuple(out)


def call_args(model: nn.Module, example_inputs: Any) -> tuple:
    """Example inputs as a call's positional arguments: a tuple as it is, a dict as keywords, else one argument."""
    if isinstance(example_inputs, Mapping):  # keyword arguments, as `model(**batch)` takes them
        return positional(model, (), example_inputs)
    return example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)


def signature(inputs: tuple) -> tuple:
    """The key of a call's plan: each input's shape, dtype and requires_grad, or a constant's repr, and the autocast
    in effect (a call under another autocast computes in other dtypes: its graph is captured again)."""
    return (
        *(
            ("tensor", tuple(x.shape), x.dtype, x.requires_grad) if isinstance(x, torch.Tensor) else ("const", repr(x))
            for x in inputs
        ),
        ("autocast", autocast_state()),
    )


def output_spec(model: nn.Module, inputs: tuple) -> tuple[TreeSpec, list[Any], list[bool]]:
    """The structure of model(*inputs), found on fake tensors (or the capture scope's earlier fake forward): its
    treespec, non-tensor leaves (TENSOR at tensors) and, for each tensor leaf, whether it has a gradient (floating
    point, requiring grad)."""

    def forward() -> Any:
        with FakeTensorMode(allow_non_fake_inputs=False) as mode:
            state, args = fake_state(mode, [*model.named_parameters(), *model.named_buffers()], inputs)
            return torch.func.functional_call(model, state, args)

    out = fake_outputs(model, inputs, forward)
    leaves = [TENSOR if isinstance(x, TensorMeta) else x for x in out.leaves]
    return out.spec, leaves, [t.differentiable for t in out.tensors]


def describe(inputs: tuple) -> str:
    """The inputs as an error names them: shape:dtype of each tensor, repr of the rest."""
    return ", ".join(
        f"{list(x.shape)}:{str(x.dtype).removeprefix('torch.')}" if isinstance(x, torch.Tensor) else repr(x)
        for x in inputs
    )
