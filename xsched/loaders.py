"""Where models, training tasks and graphs come from: `zoo:NAME`, `path/to/file.py:factory`, a graph JSON or an
external bench graph."""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported where a model is loaded: a graph file needs no torch
    import torch
    from torch import nn

from xsched.contracts.graph import Graph
from xsched.errors import XschedError


def function_from_file(path: str | Path, name: str, *, stage: str = "load") -> Callable[..., Any]:
    """The function `name` defined in the Python file at `path` (the file is run as a module)."""
    path = Path(path)
    module_spec = importlib.util.spec_from_file_location(path.stem, path)
    if module_spec is None or module_spec.loader is None or not path.exists():
        raise XschedError(f"cannot load model file {path}", stage=stage)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    fn = getattr(module, name, None)
    if not callable(fn):
        raise XschedError(f"{path} has no function {name!r}", stage=stage)
    return fn


def load_model(spec: str, batch: int | None = None, scale: str = "default") -> tuple[Any, tuple]:
    """`zoo:NAME` or `path/to/file.py:factory` -> (model, example_inputs). The factory takes `batch=` when a
    batch size is given and returns (model, example_inputs)."""
    if spec.startswith("zoo:"):
        from xsched import zoo

        z = zoo.build(spec[4:], batch=batch, scale=scale)
        return z.model, z.inputs
    path, _, factory = spec.rpartition(":")
    if not path.endswith(".py") or not factory:
        raise XschedError(f"MODEL must be zoo:NAME, file.py:factory or a graph .json, got {spec!r}", stage="load")
    fn = function_from_file(path, factory)
    model, inputs = fn(**({"batch": batch} if batch is not None else {}))
    return model, tuple(inputs) if isinstance(inputs, (list, tuple)) else (inputs,)


def load_graph(
    spec: str,
    *,
    batch: int | None = None,
    scale: str = "default",
    inference: bool = False,
    shapes: Mapping[str, Sequence[int]] | None = None,
    grad_outputs: str | Sequence[int] = "all",
    device_type: str | None = None,
) -> Graph:
    """A graph from a graph JSON, an external bench graph (networkx node-link), an ONNX model (its inference
    graph; `shapes` bind its symbolic input dimensions), or a model spec (captured; `grad_outputs`: the forward
    outputs its backward differentiates, see xsched.capture.grad_outputs; `device_type`: whose kernels compute it,
    see xsched.contracts.device_dtypes). A graph file is taken as it is: the executor runs it on any device."""
    if spec.endswith(".onnx"):
        from xsched.capture.onnx import capture_onnx

        return capture_onnx(spec, shapes)
    if shapes:
        raise XschedError("input shapes (--shape) apply to ONNX models only", stage="load")
    if spec.endswith(".json"):
        try:
            data = json.loads(Path(spec).read_text())
        except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
            raise XschedError(f"cannot read graph file {spec}: {e}", stage="load") from e
        if isinstance(data, dict) and str(data.get("schema", "")).startswith("xsched.graph"):
            return Graph.from_dict(data)
        from xsched.importers import import_networkx

        return import_networkx(spec)[0]
    from xsched.capture.torch import capture

    model, inputs = load_model(spec, batch, scale)
    return capture(model, inputs, inference=inference, name=spec, grad_outputs=grad_outputs, device_type=device_type)


Batch = tuple[tuple[Any, ...], Any]  # (model inputs, targets for the loss)
TASK_SHAPE = "(model, example_batch, loss_fn) or (model, example_batch, loss_fn, batches)"


def split_batch(batch: Any, where: str) -> Batch:
    """A batch `(inputs, targets)` with `inputs` a tensor or a tuple/list of them -> (inputs as a tuple, targets)."""
    if not isinstance(batch, (tuple, list)) or len(batch) != 2:
        got = f"a {type(batch).__name__}" + (f" of length {len(batch)}" if isinstance(batch, (tuple, list)) else "")
        raise XschedError(f"{where} must be (inputs, targets), got {got}", stage="load")
    inputs, targets = batch
    import torch

    inputs = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
    if not any(isinstance(x, torch.Tensor) for x in inputs):
        raise XschedError(
            f"{where}: the inputs hold no tensor (got {[type(x).__name__ for x in inputs]})", stage="load"
        )
    return inputs, targets


@dataclass(frozen=True)
class TrainingTask:
    """What `xsched train` trains: the model; an example batch (inputs, targets), whose input shapes are what is
    captured and planned; loss_fn(outputs, targets) -> scalar; and the data, `batches(step, rank, world)` -> the
    batch rank `rank` of `world` trains on at step `step` (0-based), or None to train on the example every step."""

    name: str
    model: nn.Module
    example_batch: Batch
    loss_fn: Callable[[Any, Any], torch.Tensor]
    batches: Callable[[int, int, int], Any] | None = None

    def batch(self, step: int, rank: int = 0, world: int = 1) -> Batch:
        if self.batches is None:
            return self.example_batch
        return split_batch(self.batches(step, rank, world), f"{self.name}: batches({step}, {rank}, {world})")


def load_training_task(spec: str, batch: int | None = None, scale: str = "default", seed: int = 0) -> TrainingTask:
    """`zoo:NAME` (the family's loss and synthetic data stream, `xsched.zoo.tasks`, drawn with `seed`) or
    `path/to/file.py:factory`, whose factory takes `batch=` when a batch size is given and returns
    (model, example_batch, loss_fn) or (model, example_batch, loss_fn, batches). `batch` is per process."""
    if spec.startswith("zoo:"):
        from functools import partial

        from xsched import zoo
        from xsched.zoo import tasks

        name = spec[4:]
        z = zoo.build(name, batch=batch, scale=scale)
        n = z.inputs[0].shape[0]
        stream = partial(tasks.task_batch, name, scale, n, seed=seed)
        return TrainingTask(spec, z.model, stream(0), tasks.task_loss(name), stream)
    path, _, factory = spec.rpartition(":")
    if not path.endswith(".py") or not factory:
        raise XschedError(f"MODEL must be zoo:NAME, hf:TYPE or file.py:factory, got {spec!r}", stage="load")
    fn = function_from_file(path, factory)
    made = fn(**({"batch": batch} if batch is not None else {}))
    if not isinstance(made, (tuple, list)) or len(made) not in (3, 4):
        got = (
            f"a {type(made).__name__} of length {len(made)}" if isinstance(made, (tuple, list)) else type(made).__name__
        )
        raise XschedError(f"{spec} returned {got}; a training factory returns {TASK_SHAPE}", stage="load")
    model, example, loss_fn, *rest = made
    from torch import nn

    if not isinstance(model, nn.Module):
        raise XschedError(f"{spec}: the model must be an nn.Module, got {type(model).__name__}", stage="load")
    if not callable(loss_fn):
        raise XschedError(f"{spec}: loss_fn must be callable, got {type(loss_fn).__name__}", stage="load")
    batches = rest[0] if rest else None
    if batches is not None and not callable(batches):
        raise XschedError(
            f"{spec}: batches must be callable (step, rank, world), got {type(batches).__name__}", stage="load"
        )
    return TrainingTask(spec, model, split_batch(example, f"{spec}: example_batch"), loss_fn, batches)
