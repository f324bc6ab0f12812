"""A model of PyTorch's CUDA caching allocator, and a plan's allocations and frees replayed on it: reserved memory.

A GPU runs out on what the caching allocator reserves (its segments), not on the plan's peak (bytes of values).
`CachingAllocator` follows the rules of `DeviceCachingAllocator` in PyTorch's c10/cuda/CUDACachingAllocator.cpp
(read at commit 001074d25084fdb87a799823e395a50f5ec044d3; each rule below names the function it follows), with
the default settings: no max_split_size, no roundup_power2_divisions, no expandable segments, no memory fraction.
`replay_reserved` walks a plan (xsched.interpret) and allocates as the executor does (xsched.execute.executor):
homed inputs first, a compute's outputs then its workspace (freed at once) on the device's compute stream, a copy
from the host on its copy lane's side stream, or on the compute stream with `copy_pool="compute"` (the executor's
option of the same name; steps._mover). It is a model, checked by hand counts, not a measurement: cudaMalloc's
addresses are unknowable, so segments are ordered by creation; blocks freed while other streams use them
(record_stream) are back in their pool by the next allocation if the GPU keeps up with the host, only after the step
if the host runs a step ahead (`host_ahead`): a run lies between the two.
"""

from __future__ import annotations

import bisect
from collections.abc import Collection, Hashable, Mapping
from dataclasses import dataclass, field

from xsched.contracts.graph import Graph, Op
from xsched.contracts.plan import Compute, Copy, Free, Plan
from xsched.contracts.profile import Profile
from xsched.interpret import PlanInterpreter
from xsched.lanes import lane_of

MIN_BLOCK = 512  # kMinBlockSize: every size is rounded up to a multiple of 512 B
SMALL_SIZE = 1 << 20  # kSmallSize: the largest request of the small pool
SMALL_SEGMENT = 2 << 20  # kSmallBuffer: small requests are carved from 2 MiB segments
MIN_LARGE_ALLOC = 10 << 20  # kMinLargeAlloc: large requests below 10 MiB share a kLargeBuffer segment
LARGE_SEGMENT = 20 << 20  # kLargeBuffer
ROUND_LARGE = 2 << 20  # kRoundLarge: a request of 10 MiB or more gets its own segment, rounded up to 2 MiB
# where the executor allocates a copy's destination on the GPU: "side", from the pool of the copy lane's side stream
# that writes it (the compute stream cannot reuse those blocks); "compute", from the compute stream's pool, the side
# stream waiting for every kernel queued on the compute stream before writing (which may delay prefetches)
COPY_POOLS = ("side", "compute")
DEFAULT_COPY_POOL = "side"


def round_size(nbytes: int) -> int:
    """The block size a request gets (round_size, default config: multiples of kMinBlockSize)."""
    return MIN_BLOCK * max(1, -(-nbytes // MIN_BLOCK))


def segment_size(size: int) -> int:
    """What cudaMalloc is asked for when no cached block fits a rounded `size` (get_allocation_size)."""
    if size <= SMALL_SIZE:
        return SMALL_SEGMENT
    if size < MIN_LARGE_ALLOC:
        return LARGE_SEGMENT
    return ROUND_LARGE * -(-size // ROUND_LARGE)


@dataclass(eq=False)  # blocks are found by identity, as torch's Block* are
class Block:
    """A piece of one segment: [offset, offset + size) of segment `segment`, free or allocated; its neighbours in
    the segment are `prev` and `next` (torch's Block::prev/next, None at the segment's ends)."""

    segment: int
    offset: int
    size: int
    allocated: bool = False  # in use: by a tensor, or freed while another stream still uses it
    prev: Block | None = field(default=None, repr=False)
    next: Block | None = field(default=None, repr=False)

    def key(self) -> tuple[int, int, int]:
        # BlockComparatorSize orders a pool by (stream, size, address); the pool index is per stream already
        return (self.size, self.segment, self.offset)


@dataclass(frozen=True)
class Segment:
    """One cudaMalloc: its size, pool (small or large) and the stream it was allocated for."""

    size: int
    small: bool
    stream: str


class CachingAllocator:
    """One device's caching allocator. `alloc(key, nbytes, stream)` and `free(key)`; `reserved` (segments) and
    `allocated` (block sizes, as torch's allocated_bytes counts them) with their peaks. `capacity` (bytes, None:
    unlimited) is where cudaMalloc fails: the allocator then gives back every wholly free segment and retries, as
    malloc's last resort (release_cached_blocks) does; a request that still does not fit is named in `out_of_memory`
    and allocated anyway, so the replay goes on."""

    def __init__(self, capacity: int | None = None) -> None:
        self.capacity = capacity
        self.segments: dict[int, Segment] = {}
        self.heads: dict[int, Block] = {}  # segment -> its first block
        self.free_index: dict[tuple[bool, str], list[tuple[int, int, int]]] = {}  # (small, stream) -> sorted keys
        self.free_blocks: dict[tuple[int, int], Block] = {}  # (segment, offset) -> free block
        self.live: dict[Hashable, Block] = {}
        self.pending: list[Block] = []  # freed, awaiting other streams (see free)
        self.reserved = self.peak_reserved = self.allocated = self.peak_allocated = 0
        self.released = 0  # segments given back to the device to make room
        self.out_of_memory: Hashable | None = None
        self._next_segment = 0

    # ---- the pools ----
    def _index(self, small: bool, stream: str) -> list[tuple[int, int, int]]:
        return self.free_index.setdefault((small, stream), [])

    def _insert_free(self, b: Block) -> None:
        seg = self.segments[b.segment]
        bisect.insort(self._index(seg.small, seg.stream), b.key())
        self.free_blocks[(b.segment, b.offset)] = b

    def _remove_free(self, b: Block) -> None:
        seg = self.segments[b.segment]
        idx = self._index(seg.small, seg.stream)
        del idx[bisect.bisect_left(idx, b.key())]
        del self.free_blocks[(b.segment, b.offset)]

    def _best_fit(self, size: int, small: bool, stream: str) -> Block | None:
        """The smallest free block of the pool that fits, lowest address first among equals; only blocks of the
        requesting stream (get_free_block: lower_bound on (stream, size), rejected when the stream differs)."""
        idx = self._index(small, stream)
        k = bisect.bisect_left(idx, (size, -1, -1))
        if k == len(idx):
            return None
        _, seg, off = idx[k]
        return self.free_blocks[(seg, off)]

    # ---- malloc and free ----
    def alloc(self, key: Hashable, nbytes: int, stream: str = "compute") -> Block | None:
        """Allocate a block for `nbytes` under `key` (nothing for 0 bytes, as torch's empty tensors)."""
        if nbytes <= 0:
            return None
        size = round_size(nbytes)
        small = size <= SMALL_SIZE  # get_pool: the small pool takes sizes up to kSmallSize
        block = self._best_fit(size, small, stream)
        if block is None:
            block = self._new_segment(key, segment_size(size), small, stream)
        self._remove_free(block)
        rest = block.size - size
        # should_split: a small block splits when 512 B or more is left; a large one only when more than kSmallSize
        # is left, else the whole block is handed out and counted as allocated (alloc_found_block)
        if (rest >= MIN_BLOCK) if small else (rest > SMALL_SIZE):
            tail = Block(block.segment, block.offset + size, rest, prev=block, next=block.next)
            if block.next is not None:
                block.next.prev = tail
            block.next, block.size = tail, size
            self._insert_free(tail)
        block.allocated = True
        self.live[key] = block
        self.allocated += block.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        return block

    def free(self, key: Hashable, in_use_elsewhere: bool = False) -> None:
        """Return `key`'s block to its pool, merged with free neighbours (free_block, try_merge_blocks). A block
        another stream still uses (record_stream) stops counting as allocated at once but joins its pool only once
        that stream's work is done (free: insert_events; process_events): here at `sync`."""
        block = self.live.pop(key, None)
        if block is None:
            return
        self.allocated -= block.size
        if in_use_elsewhere:
            self.pending.append(block)  # still marked allocated: not found, not merged (event_count > 0)
        else:
            self._return(block)

    def sync(self) -> None:
        """The other streams' work is done: every pending block goes back to its pool."""
        for block in self.pending:
            self._return(block)
        self.pending.clear()

    def _return(self, block: Block) -> None:
        block.allocated = False
        for other in (block.prev, block.next):
            if other is not None and not other.allocated:
                self._remove_free(other)
                if other is block.prev:  # block absorbs its predecessor: it starts where that one did
                    block.offset, block.prev = other.offset, other.prev
                    if other.prev is not None:
                        other.prev.next = block
                    else:
                        self.heads[block.segment] = block
                else:
                    block.next = other.next
                    if other.next is not None:
                        other.next.prev = block
                block.size += other.size
        self._insert_free(block)

    def _new_segment(self, key: Hashable, whole: int, small: bool, stream: str) -> Block:
        """cudaMalloc of `whole` bytes (alloc_block); when over capacity, first give back the wholly free segments
        of every pool and stream (release_cached_blocks: the blocks that are not split) and try again."""
        if self.capacity is not None and self.reserved + whole > self.capacity:
            self.sync()  # release_cached_blocks synchronises the device and processes every event first
            for seg, head in list(self.heads.items()):
                if not head.allocated and head.next is None:
                    self._remove_free(head)
                    self.reserved -= self.segments.pop(seg).size
                    del self.heads[seg]
                    self.released += 1
            if self.reserved + whole > self.capacity and self.out_of_memory is None:
                self.out_of_memory = key  # torch raises OutOfMemoryError here
        n = self._next_segment
        self._next_segment += 1
        self.segments[n] = Segment(whole, small, stream)
        block = self.heads[n] = Block(n, 0, whole)
        self._insert_free(block)
        self.reserved += whole
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        return block


# ---- a plan replayed on one CachingAllocator per accelerator ----
@dataclass(frozen=True)
class ReservedPeak:
    """One device's modelled memory: the plan's peak (bytes of values, as the simulator counts them), the model's
    peaks of allocated (block sizes) and reserved (segments) bytes, and what was there before the first step (the
    homed inputs). `out_of_memory`: the first value whose segment did not fit the device's capacity (None: all did)."""

    plan_peak: int
    allocated: int
    reserved: int
    base_allocated: int
    base_reserved: int
    homed: int
    released: int = 0
    out_of_memory: str | None = None

    @property
    def fragmentation(self) -> int:
        """Reserved beyond the most ever allocated: rounding, unsplit tails, free pieces that fit no request."""
        return self.reserved - self.allocated

    @property
    def over_plan(self) -> float:
        """Reserved over the plan's peak, as a share of the peak."""
        return self.reserved / self.plan_peak - 1 if self.plan_peak else 0.0

    @property
    def step_reserved(self) -> int:
        """Reserved growth during the step (what max_memory_reserved less memory_reserved before measures)."""
        return self.reserved - self.base_reserved

    @property
    def step_peak(self) -> int:
        """The plan's peak above the homed inputs."""
        return self.plan_peak - self.homed

    def as_dict(self) -> dict:
        return {**vars(self), "fragmentation": self.fragmentation, "step_reserved": self.step_reserved}


def is_host(device: str, profile: Profile | None = None) -> bool:
    """Host memory: no CUDA caching allocator there (pinned host memory has its own, not modelled)."""
    info = profile.devices.get(device) if profile is not None else None
    return device.startswith("cpu") or (info is not None and info.kind == "cpu")


class _Replay(PlanInterpreter):
    """The plan's allocations and frees, in plan order, on one CachingAllocator per modelled device."""

    def __init__(
        self,
        graph: Graph,
        plan: Plan,
        profile: Profile | None,
        devices: Collection[str],
        capacity: Mapping[str, int],
        reuse: Mapping[int, str],
        side_streams: bool,
        host_ahead: bool,
        copy_pool: str = DEFAULT_COPY_POOL,
    ) -> None:
        super().__init__(graph, plan)
        if copy_pool not in COPY_POOLS:
            raise ValueError(f"copy_pool must be one of {COPY_POOLS}, not {copy_pool!r}")
        self.copy_pool = copy_pool
        self.profile = profile
        self.reuse = reuse
        self.side_streams, self.host_ahead = side_streams, host_ahead
        self.models = {d: CachingAllocator(capacity.get(d)) for d in devices}
        self.donors: set[tuple[str, str]] = set()  # (value, device) whose block an in-place output took
        self.shared: set[tuple[str, str]] = set()  # (value, device) whose tensor a side stream used (record_stream)
        for v in graph.inputs:  # homed inputs are there before the step, allocated on the compute stream
            if (m := self.models.get(plan.homes[v])) is not None:
                m.alloc(v, self.nbytes[v])
        self.base = {d: (m.allocated, m.reserved) for d, m in self.models.items()}

    def workspace(self, i: int, s: Compute, op: Op) -> int:
        cost = self.profile.op_cost(op.id, s.device) if self.profile is not None else None
        return max(op.workspace_bytes, cost.workspace_bytes if cost else 0)

    def on_compute(self, i: int, s: Compute, op: Op) -> None:
        m = self.models.get(s.device)
        if m is None:
            return
        donor, replaced = self.reuse.get(i), []
        for v in op.outputs:
            if donor is not None and donor in m.live:  # the op writes into its dying input's block (compile_inplace)
                m.live[v] = m.live.pop(donor)
                self.donors.add((donor, s.device))
            elif v in m.live:  # computed again while resident: the old tensor goes once the store holds the new
                replaced.append(v)
                m.alloc(f"{v}@new", self.nbytes[v])
            else:
                m.alloc(v, self.nbytes[v])
        m.alloc(f"workspace@{i}", self.workspace(i, s, op))  # scratch inside the op, released before it returns
        m.free(f"workspace@{i}")
        for v in replaced:
            m.free(v)
            if f"{v}@new" in m.live:
                m.live[v] = m.live.pop(f"{v}@new")

    def on_copy(self, i: int, s: Copy) -> None:
        m = self.models.get(s.dst)
        if m is not None:
            # from the host on lanes: the copy lane's side stream's pool (copy_pool "side"), else the compute one
            side = self.side_streams and s.src not in self.models and self.copy_pool == "side"
            m.alloc(s.value, self.nbytes[s.value], lane_of(s) if side else "compute")
            if self.side_streams and (side or self.copy_pool == "compute"):
                # another stream uses it: the compute stream reads it (record_stream(reader)), or the side stream
                # writes it into a compute-stream block (record_stream(side))
                self.shared.add((s.value, s.dst))
        if self.side_streams and s.src in self.models:  # read on the copy lane's side stream: t.record_stream(side)
            self.shared.add((s.value, s.src))

    def on_free(self, i: int, s: Free) -> None:
        m = self.models.get(s.device)
        shared = (s.value, s.device) in self.shared
        self.shared.discard((s.value, s.device))
        if m is not None and not self._donated(s.value, s.device):
            m.free(s.value, in_use_elsewhere=shared and self.host_ahead)

    def _donated(self, v: str, d: str) -> bool:
        if (v, d) in self.donors:
            self.donors.discard((v, d))  # its block lives on under the output; a later compute of v is new
            return True
        return False

    def end(self) -> dict[str, ReservedPeak]:
        out = {}
        for d, m in self.models.items():
            homed = sum(self.nbytes[v] for v, h in self.plan.homes.items() if h == d)
            oom = None if m.out_of_memory is None else str(m.out_of_memory)
            out[d] = ReservedPeak(
                self.peak[d], m.peak_allocated, m.peak_reserved, *self.base[d], homed, m.released, oom
            )
        return out


def replay_reserved(
    graph: Graph,
    plan: Plan,
    profile: Profile | None = None,
    *,
    devices: Collection[str] | None = None,
    capacity: Mapping[str, int] | None = None,
    reuse: Mapping[int, str] | None = None,
    side_streams: bool = True,
    host_ahead: bool = False,
    copy_pool: str = DEFAULT_COPY_POOL,
) -> dict[str, ReservedPeak]:
    """Per modelled device (default: every plan device that is not the host): the plan's allocations and frees
    replayed on PyTorch's caching allocator rules. `capacity`: device bytes where cudaMalloc fails (default none);
    `reuse`: compute step -> the input it overwrites in place (the executor's `reuse`, when known); `side_streams`:
    copies run on their lane's side stream, as the executor on its lanes does, so the blocks they read or write are
    shared with it (record_stream; off: in plan order on the compute stream, nothing shared). The GPU's progress is unknown: by default blocks freed after use
    on another stream are back in their pool by the next allocation (the GPU keeps up); with `host_ahead` not until
    the step ends (the host runs a whole step ahead, as the executor's lanes may). A run lies between the two.
    `copy_pool`: the executor's option of that name (COPY_POOLS)."""
    if devices is None:
        devices = [d for d in plan.devices if not is_host(d, profile)]
    replay = _Replay(graph, plan, profile, devices, capacity or {}, reuse or {}, side_streams, host_ahead, copy_pool)
    return replay.run()


def reserved_range(
    graph: Graph,
    plan: Plan,
    profile: Profile | None = None,
    *,
    devices: Collection[str] | None = None,
    reuse: Mapping[int, str] | None = None,
    side_streams: bool = True,
    copy_pool: str = DEFAULT_COPY_POOL,
) -> dict[str, tuple[ReservedPeak, ReservedPeak]]:
    """Per modelled device: (the GPU keeping up, the host a step ahead), the two ends between which a run is
    expected; the same twice where no tensor is shared across streams. Arguments as replay_reserved's."""
    low, high = (
        replay_reserved(
            graph,
            plan,
            profile,
            devices=devices,
            reuse=reuse,
            side_streams=side_streams,
            host_ahead=ahead,
            copy_pool=copy_pool,
        )
        for ahead in (False, True)
    )
    return {d: (low[d], high[d]) for d in low}
