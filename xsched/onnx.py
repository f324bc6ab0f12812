"""ONNX models through xsched: `session(path, budgets, providers)` places a model's nodes across ONNX Runtime's
execution providers by measured cost under memory budgets and runs it with ONNX Runtime's `run` signature.

Imports of onnx and onnxruntime are lazy: the rest of xsched works without them.
"""

from __future__ import annotations

from typing import Any


def session(*args: Any, **kwargs: Any) -> Any:
    """A PlacedSession (xsched.execute.ort_session): session(path, budgets, providers, ...).run(output_names, feeds)."""
    from xsched.execute.ort_session import PlacedSession

    return PlacedSession(*args, **kwargs)


__all__ = ["session"]
