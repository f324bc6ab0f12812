"""A wrapped call's signature: the key its plan is kept under (its inputs' shapes and dtypes, the autocast), their description
in errors, and the structure of the call's outputs."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import TreeSpec

from xsched.capture.reuse import TensorMeta, autocast_state, fake_outputs, fake_state


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
    treespec, non-tensor leaves (None at tensors) and, for each tensor leaf, whether it has a gradient (floating
    point, requiring grad)."""

    def forward() -> Any:
        with FakeTensorMode(allow_non_fake_inputs=False) as mode:
            state, args = fake_state(mode, [*model.named_parameters(), *model.named_buffers()], inputs)
            return torch.func.functional_call(model, state, args)

    out = fake_outputs(model, inputs, forward)
    leaves = [None if isinstance(x, TensorMeta) else x for x in out.leaves]
    return out.spec, leaves, [t.differentiable for t in out.tensors]


def describe(inputs: tuple) -> str:
    """The inputs as an error names them: shape:dtype of each tensor, repr of the rest."""
    return ", ".join(
        f"{list(x.shape)}:{str(x.dtype).removeprefix('torch.')}" if isinstance(x, torch.Tensor) else repr(x)
        for x in inputs
    )
