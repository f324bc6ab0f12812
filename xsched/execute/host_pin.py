"""Host memory pinned once: the one helper every pinned host allocation goes through, pinned slabs that buffers
are views of (torch rounds each pinned allocation up to a power of two), and a wrapped module's parameters and
buffers moved to their homes, pinned beside a GPU in the memory they end in (an optimizer's buffers, or their own)
at the first run."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import torch
from torch import nn

from xsched.execute.reference import torch_device


def pins_host(devices: Iterable[torch.device]) -> bool:
    """Whether host tensors beside these devices are pinned: a GPU among them (and a build of torch with CUDA),
    so that the plan's copies between the host and the GPU run asynchronously."""
    return any(d.type == "cuda" for d in devices) and torch.cuda.is_available()


def pinned_empty(shape: torch.Size | tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A new uninitialized pinned host tensor: every pinned host allocation of a weight's home goes through here
    (tests count the bytes by replacing it; the CPU build of torch cannot pin)."""
    return torch.empty(shape, dtype=dtype, device="cpu", pin_memory=True)


def pin_host(t: torch.Tensor) -> torch.Tensor:
    """A pinned copy of the host tensor `t`, laid out as torch.empty_like lays it out (one allocation and one copy
    of its bytes)."""
    layout = torch.empty_like(t, device="meta")  # its strides, without allocating
    out = pinned_empty((t.numel(),), t.dtype).as_strided(t.shape, layout.stride())
    out.copy_(t)
    return out


SLAB_BYTES = 1 << 30  # the largest slab (a power of two): its unused end costs less than the buffer that missed it
ALIGN = 64  # bytes: each buffer in a slab starts on a cache line


class PinnedSlabs:
    """Pinned host buffers of one dtype handed out as views of a few large pinned slabs. Torch's host allocator
    (CachingHostAllocator) rounds each pinned allocation up to a power of two, so a 40 MiB weight pinned alone
    holds 64 MiB; a slab is a power of two, so it holds no more than asked. `sizes`: the buffers (elements) to be
    handed out, placed up front, largest first, each into the first slab with room, else into a new one of the
    largest power of two within what is left to place (at most SLAB_BYTES, at least the buffer). A buffer asked
    for beyond `sizes` is placed when asked. A slab is allocated when its first buffer is handed out."""

    def __init__(self, dtype: torch.dtype, sizes: Sequence[int]) -> None:
        self.dtype = dtype
        self._step = ALIGN // dtype.itemsize
        self._slabs: list[torch.Tensor | None] = []
        self._size: list[int] = []  # elements of each slab
        self._used: list[int] = []  # elements placed in each slab
        self._placed: dict[int, list[tuple[int, int]]] = {}  # numel -> (slab, offset) of each buffer, last first
        left = sum(self._aligned(n) for n in sizes)
        for n in sorted(sizes, reverse=True):
            self._placed.setdefault(n, []).insert(0, self._place(self._aligned(n), left))
            left -= self._aligned(n)

    def empty(self, numel: int) -> torch.Tensor:
        """A new uninitialized pinned 1-D buffer of `numel` elements."""
        places = self._placed.get(numel)
        k, off = places.pop() if places else self._place(self._aligned(numel), self._aligned(numel))
        slab = self._slabs[k]
        if slab is None:
            slab = self._slabs[k] = pinned_empty((self._size[k],), self.dtype)
        return slab[off : off + numel]

    def pin(self, t: torch.Tensor) -> torch.Tensor:
        """A pinned contiguous copy of the host tensor `t` (of this dtype) in a slab: one copy of its bytes."""
        out = self.empty(t.numel()).view(t.shape)
        out.copy_(t)
        return out

    def _aligned(self, numel: int) -> int:
        return -(-numel // self._step) * self._step

    def _place(self, need: int, left: int) -> tuple[int, int]:
        """A (slab, offset) for `need` elements: in the first slab with room, else in a new one sized by `left`."""
        k = next((i for i, used in enumerate(self._used) if used + need <= self._size[i]), None)
        if k is None:
            item = self.dtype.itemsize
            self._size.append(max(_pow2_floor(min(SLAB_BYTES, left * item)), _pow2_ceil(need * item)) // item)
            self._used.append(0)
            self._slabs.append(None)
            k = len(self._size) - 1
        off = self._used[k]
        self._used[k] += need
        return k, off


def _pow2_ceil(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _pow2_floor(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


def move_to_homes(module: nn.Module, home_of: Mapping[str, str], dev: Mapping[str, torch.device]) -> None:
    """Each parameter and buffer named in `home_of` onto its home's torch device (the others stay where they are),
    so that gradients land where autograd expects them. Nothing is pinned here: see `pin_unpinned`."""
    with torch.no_grad():
        for name, t in [*module.named_parameters(), *module.named_buffers()]:
            to = torch_device(home_of[name], dev) if name in home_of else t.device
            if t.device != to:
                t.data = t.data.to(to)


def pin_unpinned(module: nn.Module) -> int:
    """Pin the host parameters and buffers that nothing pinned yet (contiguous ones into slabs per dtype, each a
    view of its own part); the bytes copied. Run once, at the first run: an optimizer built before it
    (train.host_buckets) has packed the parameters it owns into its own pinned buffers, not pinned again here."""
    unpinned = [t for t in [*module.parameters(), *module.buffers()] if t.device.type == "cpu" and not t.is_pinned()]
    sizes: dict[torch.dtype, list[int]] = {}
    for t in unpinned:
        if t.is_contiguous():
            sizes.setdefault(t.dtype, []).append(t.numel())
    slabs = {dtype: PinnedSlabs(dtype, numels) for dtype, numels in sizes.items()}
    with torch.no_grad():
        for t in unpinned:
            t.data = slabs[t.dtype].pin(t.data) if t.is_contiguous() else pin_host(t.data)
    return sum(t.numel() * t.element_size() for t in unpinned)
