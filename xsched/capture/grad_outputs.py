"""Which forward outputs a captured training step differentiates (capture's `grad_outputs`), and the outputs a loss
function reads, found on fake tensors (what `xsched train` differentiates)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Union

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_map, tree_unflatten

from xsched.capture.blocks import recorded_for_reuse
from xsched.capture.reuse import TensorMeta, fake_outputs, fake_state
from xsched.errors import CaptureError

# "all": every differentiable output gets a gradient input (a tangent); "auto": the forward's scalar outputs when
# it returns any (its losses, as Hugging Face models and the zoo's GPT-2 return (logits, loss) and are trained by
# `loss.backward()`), else all; or the positions, among the forward's tensor outputs, that get one.
GradOutputs = Union[str, Sequence[int]]


def differentiated(spec: GradOutputs, differentiable: Sequence[bool], scalar: Sequence[bool]) -> tuple[bool, ...]:
    """For each forward output, whether the backward gets its gradient: `spec` resolved against which outputs are
    differentiable (floating point, requiring grad) and which are scalars."""
    if spec == "all":
        return tuple(differentiable)
    if spec == "auto":
        losses = tuple(d and s for d, s in zip(differentiable, scalar))
        return losses if any(losses) else tuple(differentiable)
    if isinstance(spec, str) or not all(isinstance(k, int) and not isinstance(k, bool) for k in spec):
        raise CaptureError(f"grad_outputs must be 'all', 'auto' or a sequence of output positions, got {spec!r}")
    n = len(differentiable)
    for k in spec:
        if not 0 <= k < n:
            raise CaptureError(f"grad_outputs names output {k}, but the forward returns {n} tensors")
        if not differentiable[k]:
            raise CaptureError(f"grad_outputs names output {k}, which has no gradient (not floating point or no grad)")
    if not spec:
        raise CaptureError("grad_outputs names no output; a training step differentiates at least one")
    return tuple(k in spec for k in range(n))


def loss_outputs(
    model: nn.Module, inputs: tuple, loss_fn: Callable[[Any, Any], torch.Tensor], targets: Any
) -> tuple[int, ...] | None:
    """Positions of the forward's tensor outputs that `loss_fn(model(*inputs), targets)` differentiates, found by
    one forward (or the capture scope's earlier one) and the loss on fake tensors (no compute, no memory); None when the loss cannot run on them (it
    branches on a value) or reads no output's gradient: then every output is differentiated, as before."""
    with FakeTensorMode(allow_non_fake_inputs=False) as mode:
        fake = lambda t: mode.from_tensor(t) if isinstance(t, torch.Tensor) else t  # noqa: E731

        def forward() -> Any:
            state, args = fake_state(mode, [*model.named_parameters(), *model.named_buffers()], inputs)
            return torch.func.functional_call(model, state, args)

        try:
            with torch.enable_grad():
                with recorded_for_reuse(model, inputs):  # the blocks' calls, for a capture with reuse_blocks
                    out = fake_outputs(model, inputs, forward)
                # fresh leaves: the loss's dependence on each output, not through the model (its loss on its logits)
                cut = [x.leaf() if isinstance(x, TensorMeta) else x for x in out.leaves]
                loss = loss_fn(tree_unflatten(cut, out.spec), tree_map(fake, targets))
                tensors = [x for x in cut if isinstance(x, torch.Tensor)]
                wrt = [k for k, t in enumerate(tensors) if t.requires_grad]
                if not isinstance(loss, torch.Tensor) or not loss.requires_grad or not wrt:
                    return None
                grads = torch.autograd.grad(loss, [tensors[k] for k in wrt], allow_unused=True)
        except Exception:  # whatever stops the fake run leaves the capture as it was: every output differentiated
            return None
    used = tuple(k for k, g in zip(wrt, grads) if g is not None)
    return used or None
