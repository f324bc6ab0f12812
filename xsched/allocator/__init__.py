"""A model of PyTorch's CUDA caching allocator (caching) and a plan replayed on it (replay): reserved memory."""

from xsched.allocator.caching import Block, CachingAllocator, Segment, round_size, segment_size
from xsched.allocator.replay import (
    COPY_POOLS,
    DEFAULT_COPY_POOL,
    ReservedPeak,
    is_host,
    replay_reserved,
    reserved_range,
)

__all__ = [
    "COPY_POOLS",
    "DEFAULT_COPY_POOL",
    "Block",
    "CachingAllocator",
    "ReservedPeak",
    "Segment",
    "is_host",
    "replay_reserved",
    "reserved_range",
    "round_size",
    "segment_size",
]
