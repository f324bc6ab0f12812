"""Where models and graphs come from: `zoo:NAME`, `path/to/file.py:factory`, a graph JSON or an external bench graph."""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from xsched.errors import XschedError
from xsched.graph import Graph


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
) -> Graph:
    """A graph from a graph JSON, an external bench graph (networkx node-link), an ONNX model (its inference
    graph; `shapes` bind its symbolic input dimensions), or a model spec (captured)."""
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
    return capture(model, inputs, inference=inference, name=spec)
