"""Capture: models -> Graph (PyTorch modules through xsched.capture.torch)."""

from xsched.capture.torch import CapturedOutputs, bind_inputs, capture, unpack_outputs

__all__ = ["CapturedOutputs", "bind_inputs", "capture", "unpack_outputs"]
