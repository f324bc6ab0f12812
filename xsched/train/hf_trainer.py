"""`transformers.Trainer` with xsched plans: swap `Trainer` for `XschedTrainer(..., budgets={"cuda": "50%"})` and
every training forward and backward runs a plan within the budgets; the rest of the Trainer (data, optimizer,
schedule, gradient accumulation, clipping, logging, saving, evaluation) is its own.

How: the Trainer's own compute_loss runs with the model replaced by a planned callable. That callable captures
`model(**batch).loss` once per batch signature (the keys, shapes and dtypes of the batch's tensors), plans it with
`xsched.wrap` (the same parameter objects, so the Trainer's optimizer and clipping see their gradients) and returns
`{"loss": ...}`. Evaluation, `return_outputs`, label smoothing and a `compute_loss_func` need the model's logits,
which a plan does not hand out: those calls run the plain model."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from xsched.errors import XschedError

try:
    from transformers import Trainer
except ImportError as e:  # a clear line instead of a traceback from deep inside
    raise XschedError("XschedTrainer needs transformers: pip install 'xsched[hf]'", stage="load") from e


class _KwargsLoss(nn.Module):
    """forward(*tensors) -> model(**dict(zip(keys, tensors)), **constants).loss: a keyword-called model as the
    positional module `wrap` captures."""

    def __init__(self, model: nn.Module, keys: Sequence[str], constants: Mapping[str, Any]) -> None:
        super().__init__()
        self.model = model
        self.keys, self.constants = tuple(keys), dict(constants)

    def forward(self, *tensors: torch.Tensor) -> torch.Tensor:
        out = self.model(**dict(zip(self.keys, tensors)), **self.constants)
        return out["loss"] if isinstance(out, Mapping) else out[0]


class _Planned:
    """`model(**batch)` through xsched plans, one per batch signature, returning {"loss": loss}."""

    def __init__(self, model: nn.Module, options: Mapping[str, Any]) -> None:
        self.model, self.options = model, dict(options)
        self.wrapped: dict[tuple, nn.Module] = {}

    def __call__(self, **batch: Any) -> dict[str, torch.Tensor]:
        from xsched.execute.wrap import wrap

        # an int count of label tokens (the Trainer's num_items_in_batch) as a tensor input: a constant would be
        # captured into the graph and need a new plan whenever it changes
        batch = {
            k: torch.tensor(v) if k == "num_items_in_batch" and isinstance(v, int) else v for k, v in batch.items()
        }
        keys = tuple(k for k, v in batch.items() if isinstance(v, torch.Tensor))
        constants = {k: v for k, v in batch.items() if not isinstance(v, torch.Tensor)}
        key = (keys, repr(sorted(constants.items())))
        if key not in self.wrapped:
            module = _KwargsLoss(self.model, keys, constants)
            self.wrapped[key] = wrap(module, tuple(batch[k] for k in keys), **self.options)
        return {"loss": self.wrapped[key](*(batch[k] for k in keys))}


class XschedTrainer(Trainer):
    """A `transformers.Trainer` whose training steps run xsched plans within `budgets` (per device, e.g.
    {"cpu": "50%"} or {"cuda:0": "60%"}; "%" is of the eager peak). `devices`, `method`, `time_limit`, `profile`,
    `profile_dir`, `stores` and `param_home` are `xsched.wrap`'s; every other argument is the Trainer's.
    `.planned.wrapped` holds the wrapped modules (one per batch signature): `.plan`, `.report()`."""

    def __init__(
        self,
        *args: Any,
        budgets: Mapping[str, str | int],
        devices: Sequence[str] | None = None,
        method: str = "auto",
        time_limit: float | None = None,
        profile: str = "measure",
        profile_dir: str | None = None,
        stores: Sequence[str] = (),
        param_home: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.xsched_options = dict(
            budgets=dict(budgets),
            devices=devices,
            method=method,
            time_limit=time_limit,
            profile=profile,
            profile_dir=profile_dir,
            stores=stores,
            param_home=param_home,
        )
        self.planned: _Planned | None = None

    def compute_loss(
        self,
        model: nn.Module,
        inputs: dict[str, Any],
        return_outputs: bool = False,
        num_items_in_batch: torch.Tensor | int | None = None,
    ) -> Any:
        """The Trainer's own compute_loss, the training forward and backward run by a plan."""
        plain = return_outputs or self.label_smoother is not None or self.compute_loss_func is not None
        if plain or not (model.training and torch.is_grad_enabled()):
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        if self.planned is None or self.planned.model is not model:
            self.planned = _Planned(model, self.xsched_options)
        return super().compute_loss(self.planned, inputs, return_outputs, num_items_in_batch)  # type: ignore[arg-type]
