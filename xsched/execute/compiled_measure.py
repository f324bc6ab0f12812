"""The most bytes a call allocates on a device above what was live when it began, from the allocator's events."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def measured_peak(
    fn: Callable[[], Any], device: torch.device, watch: list[torch.Tensor] | None = None
) -> tuple[Any, int]:
    """fn() and the most bytes live on `device` during it above what was live when it began (frees of earlier
    blocks lower it), from the allocator's events: the CPU allocator and CUDA's caching allocator both report
    each allocation and free to the profiler. It reports nothing for the free of a block allocated before it
    started, so each tensor of `watch` (inputs fn may free; the list is emptied, leaving fn the only holder) marks
    its own death in the trace, with its bytes."""
    import weakref

    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts, profile_memory=True) as prof:
        for t in watch or ():
            weakref.finalize(t, _mark, f"{_DIED}{t.untyped_storage().nbytes()}")
        if watch:
            watch.clear()
        t = None
        result = fn()
    nodes, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        n = stack.pop()
        nodes.append(n)
        stack.extend(n.children)
    index = device.index if device.type == "cuda" else None
    allocs = sorted(
        (
            n
            for n in nodes
            if n.tag == _EventType.Allocation
            and n.extra_fields.device.type == device.type
            and (index is None or n.extra_fields.device.index in (index, None))
        ),
        key=lambda n: n.start_time_ns,
    )
    died = [n for n in nodes if n.name.startswith(_DIED)]
    live: dict[int, int] = {}
    now = peak = 0
    for n in sorted(allocs + died, key=lambda n: n.start_time_ns):
        if n.name.startswith(_DIED):  # an input fn let go of, at its last use
            now -= int(n.name[len(_DIED) :])
            continue
        ptr, size = n.extra_fields.ptr, n.extra_fields.alloc_size
        if size > 0:
            live[ptr] = size
            now += size
        elif ptr in live:
            now -= live.pop(ptr)
        peak = max(peak, now)
    return result, peak


_DIED = "xsched::died:"


def _mark(name: str) -> None:
    with torch.profiler.record_function(name):
        pass
