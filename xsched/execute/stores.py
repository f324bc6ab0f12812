"""Per-device tensor stores: the values resident on one logical device and their byte accounting."""

from __future__ import annotations

import threading
from collections.abc import Mapping

import torch


class DeviceStore:
    """Value id -> tensor resident on one logical device, with resident bytes counted as the simulator does.

    Bytes are the graph's `Value.nbytes` (not the tensor's storage), so the count after each step equals
    `SimResult.resident_after`. A graph input may be reserved before its tensor exists (a tangent is
    resident from the start in the plan semantics but only arrives when backward runs).
    """

    def __init__(self, name: str, device: torch.device, nbytes: Mapping[str, int]) -> None:
        self.name = name
        self.device = device
        self.nbytes = nbytes
        self.tensors: dict[str, torch.Tensor] = {}
        self.reserved: set[str] = set()
        self.bytes = 0
        self.peak = 0
        self._lock = threading.Lock()

    def __contains__(self, vid: str) -> bool:
        return vid in self.tensors or vid in self.reserved

    def reserve(self, vid: str) -> None:
        with self._lock:
            if vid not in self.tensors and vid not in self.reserved:
                self.reserved.add(vid)
                self._grow(vid)

    def fill(self, tensors: dict[str, torch.Tensor]) -> None:
        """Start an empty store with `tensors` resident (their dict becomes the store's)."""
        assert not self.tensors and not self.reserved
        self.tensors = tensors
        self.bytes = self.peak = sum(map(self.nbytes.__getitem__, tensors))

    def put(self, vid: str, t: torch.Tensor) -> None:
        """Make `vid` resident; a value already resident (recomputed while held) keeps its bytes counted once."""
        with self._lock:
            if vid in self.reserved:
                self.reserved.discard(vid)
            elif vid not in self.tensors:  # _grow, inlined: this runs once per computed value
                self.bytes += self.nbytes[vid]
                if self.bytes > self.peak:
                    self.peak = self.bytes
            self.tensors[vid] = t

    def drop(self, vid: str) -> torch.Tensor | None:
        with self._lock:
            if vid in self.reserved:
                self.reserved.discard(vid)
                self.bytes -= self.nbytes[vid]
                return None
            t = self.tensors.pop(vid)
            self.bytes -= self.nbytes[vid]
            return t

    def _grow(self, vid: str) -> None:
        self.bytes += self.nbytes[vid]
        if self.bytes > self.peak:
            self.peak = self.bytes
