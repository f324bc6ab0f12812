"""PyTorch's CUDA caching-allocator settings that the executor may change: expandable segments."""

from __future__ import annotations

from collections.abc import Iterable

import torch


def use_expandable_segments(devices: Iterable[torch.device], on: bool = True) -> bool:
    """Turn the CUDA caching allocator's `expandable_segments` on (or off) when a device is a GPU, as
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True would at start-up: each pool of each stream then grows one
    segment by mapping pages, so freed blocks merge across what would have been separate cudaMallocs
    (xsched.allocator.caching models both). The setting is the process's, and governs only the segments made after
    it: tensors allocated before keep their cudaMalloc'd segments. Returns whether it was set: False, a no-op, when
    no device is a GPU (CPU memory has no caching allocator)."""
    if not any(d.type == "cuda" for d in devices):
        return False
    torch.cuda.memory._set_allocator_settings(f"expandable_segments:{on}")
    return True
