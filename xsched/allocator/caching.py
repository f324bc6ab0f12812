"""A model of PyTorch's CUDA caching allocator: segments, blocks, best fit, splits, merges; reserved memory.

`CachingAllocator` follows the rules of `DeviceCachingAllocator` in PyTorch's c10/cuda/CUDACachingAllocator.cpp
(read at commit 001074d25084fdb87a799823e395a50f5ec044d3; each rule below names the function it follows), with no
max_split_size, no roundup_power2_divisions and no memory fraction. `expandable` is the `expandable_segments`
setting (PYTORCH_CUDA_ALLOC_CONF, or torch.cuda.memory._set_allocator_settings at run time): off, each segment is one
cudaMalloc; on, each pool (small, large) of each stream grows one segment of reserved address space by mapping
pages (2 MiB for the small pool, 20 MiB for the large one), and the blocks of that segment merge across what would
have been segment boundaries. The setting may change between allocations: it governs the segments made after it.
cudaMalloc's addresses are unknowable, so segments are ordered by creation.
"""

from __future__ import annotations

import bisect
from collections.abc import Hashable
from dataclasses import dataclass, field

MIN_BLOCK = 512  # kMinBlockSize: every size is rounded up to a multiple of 512 B
SMALL_SIZE = 1 << 20  # kSmallSize: the largest request of the small pool
SMALL_SEGMENT = 2 << 20  # kSmallBuffer: small requests are carved from 2 MiB segments (expandable: 2 MiB pages)
MIN_LARGE_ALLOC = 10 << 20  # kMinLargeAlloc: large requests below 10 MiB share a kLargeBuffer segment
LARGE_SEGMENT = 20 << 20  # kLargeBuffer (expandable: the large pool's 20 MiB pages)
ROUND_LARGE = 2 << 20  # kRoundLarge: a request of 10 MiB or more gets its own segment, rounded up to 2 MiB
ADDRESS_SPACE = 1 << 40  # an expandable segment's address space when the device's size is not given (torch: 9/8 of it)


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


def page_size(small: bool) -> int:
    """An expandable segment's page: what is mapped at a time (find_expandable_block's segment_size)."""
    return SMALL_SEGMENT if small else LARGE_SEGMENT


def pages(nbytes: int, page: int) -> int:
    """`nbytes` rounded up to whole pages (ExpandableSegment::map maps whole pages from a page boundary)."""
    return page * -(-nbytes // page)


@dataclass(eq=False)  # blocks are found by identity, as torch's Block* are
class Block:
    """A piece of one segment: [offset, offset + size) of segment `segment`, allocated or free, and mapped or not
    (only in an expandable segment: address space without pages); its neighbours in the segment are `prev` and
    `next` (torch's Block::prev/next, None at the segment's ends)."""

    segment: int
    offset: int
    size: int
    allocated: bool = False  # in use: by a tensor, or freed while another stream still uses it
    mapped: bool = True
    prev: Block | None = field(default=None, repr=False)
    next: Block | None = field(default=None, repr=False)

    def key(self) -> tuple[int, int, int]:
        # BlockComparatorSize orders a pool by (stream, size, address); the pool index is per stream already
        return (self.size, self.segment, self.offset)


@dataclass(frozen=True)
class Segment:
    """One cudaMalloc (`page` 0) or one expandable segment (`page`: its page size; `size`: its address space, of
    which only the mapped blocks are reserved): its pool (small or large) and the stream it was made for."""

    size: int
    small: bool
    stream: str
    page: int = 0


class CachingAllocator:
    """One device's caching allocator. `alloc(key, nbytes, stream)` and `free(key)`; `reserved` (cudaMalloc'd
    segments and mapped pages) and `allocated` (block sizes, as torch's allocated_bytes counts them) with their
    peaks. `capacity` (bytes, None: unlimited) is where the device has no more memory: the allocator then gives back
    what it caches (release_cached_blocks: wholly free segments, the free whole pages of expandable segments) and
    retries, as malloc's last resort does; a request that still does not fit is named in `out_of_memory` and
    allocated anyway, so the replay goes on."""

    def __init__(self, capacity: int | None = None, expandable: bool = False) -> None:
        self.capacity = capacity
        self.expandable = expandable  # the setting now; segments made earlier keep their kind
        self.segments: dict[int, Segment] = {}
        self.heads: dict[int, Block] = {}  # segment -> its first block
        self.free_index: dict[tuple[bool, str], list[tuple[int, int, int]]] = {}  # (small, stream) -> sorted keys
        self.free_blocks: dict[tuple[int, int], Block] = {}  # (segment, offset) -> free mapped block
        self.unmapped_index: dict[tuple[bool, str], list[tuple[int, int]]] = {}  # address order (BlockPool.unmapped)
        self.unmapped_blocks: dict[tuple[int, int], Block] = {}
        self.live: dict[Hashable, Block] = {}
        self.pending: list[Block] = []  # freed, awaiting other streams (see free)
        self.reserved = self.peak_reserved = self.allocated = self.peak_allocated = 0
        self.released = 0  # segments given back, or page ranges unmapped, to make room
        self.out_of_memory: Hashable | None = None
        self._next_segment = 0

    # ---- the pools ----
    def _pool(self, b: Block) -> tuple[bool, str]:
        seg = self.segments[b.segment]
        return seg.small, seg.stream

    def _insert_free(self, b: Block) -> None:
        bisect.insort(self.free_index.setdefault(self._pool(b), []), b.key())
        self.free_blocks[(b.segment, b.offset)] = b

    def _remove_free(self, b: Block) -> None:
        idx = self.free_index[self._pool(b)]
        del idx[bisect.bisect_left(idx, b.key())]
        del self.free_blocks[(b.segment, b.offset)]

    def _insert_unmapped(self, b: Block) -> None:
        bisect.insort(self.unmapped_index.setdefault(self._pool(b), []), (b.segment, b.offset))
        self.unmapped_blocks[(b.segment, b.offset)] = b

    def _remove_unmapped(self, b: Block) -> None:
        idx = self.unmapped_index[self._pool(b)]
        del idx[bisect.bisect_left(idx, (b.segment, b.offset))]
        del self.unmapped_blocks[(b.segment, b.offset)]

    def _expandable(self, b: Block) -> bool:
        return self.segments[b.segment].page > 0

    def _reach(self, b: Block) -> int:
        """A free block's size for best fit in an expandable segment: with the unmapped space after it."""
        return b.size + (b.next.size if b.next is not None and not b.next.mapped else 0)

    def _best_fit(self, size: int, small: bool, stream: str) -> Block | None:
        """The smallest free block of the pool that fits, lowest address first among equals; only blocks of the
        requesting stream (get_free_block: lower_bound on (stream, size), rejected when the stream differs). A block
        of an expandable segment counts as large as it could grow, so the free end of a segment is taken only when
        no other block fits; with the setting off, expandable blocks are passed over."""
        idx = self.free_index.get((small, stream), [])
        at = (self.free_blocks[idx[j][1:]] for j in range(bisect.bisect_left(idx, (size, -1, -1)), len(idx)))
        if not self.expandable:
            return next((b for b in at if not self._expandable(b)), None)
        best = next(at, None)
        for b in at:  # larger blocks, while the best so far could grow further than they are
            if best is None or not self._expandable(best) or self._reach(b) >= self._reach(best):
                break
            best = b
        return best

    def _splits(self, rest: int, small: bool) -> bool:
        # should_split: a small block splits when 512 B or more is left, as any block does with expandable segments
        # on; a large one otherwise only when more than kSmallSize is left, else it is handed out whole
        return rest >= MIN_BLOCK if small or self.expandable else rest > SMALL_SIZE

    # ---- malloc and free ----
    def alloc(self, key: Hashable, nbytes: int, stream: str = "compute") -> Block | None:
        """Allocate a block for `nbytes` under `key` (nothing for 0 bytes, as torch's empty tensors)."""
        if nbytes <= 0:
            return None
        size = round_size(nbytes)
        small = size <= SMALL_SIZE  # get_pool: the small pool takes sizes up to kSmallSize
        block = self._best_fit(size, small, stream)
        if block is None:
            block = self._grow(key, size, small, stream)
        self._remove_free(block)
        if self._splits(block.size - size, small):  # alloc_found_block: the rest stays free in the pool
            self._insert_free(self._split(block, size))
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
        self._merge_free(block)

    # ---- blocks of a segment ----
    def _split(self, block: Block, size: int) -> Block:
        """Cut `block` after `size` bytes; the tail (same mapping, free) is returned, in no index yet."""
        tail = Block(block.segment, block.offset + size, block.size - size, mapped=block.mapped)
        tail.prev, tail.next = block, block.next
        if block.next is not None:
            block.next.prev = tail
        block.next, block.size = tail, size
        return tail

    def _absorb(self, block: Block, other: Block) -> None:
        """`block` takes over its neighbour `other` (try_merge_blocks), which the caller took out of its index."""
        if other is block.prev:  # block starts where its predecessor did
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

    def _merge_free(self, block: Block) -> None:
        """A free mapped block merged with its free mapped neighbours, into the pool (free_block)."""
        for other in (block.prev, block.next):
            if other is not None and not other.allocated and other.mapped:
                self._remove_free(other)
                self._absorb(block, other)
        self._insert_free(block)

    def _merge_unmapped(self, block: Block) -> None:
        for other in (block.prev, block.next):
            if other is not None and not other.mapped:
                self._remove_unmapped(other)
                self._absorb(block, other)
        self._insert_unmapped(block)

    # ---- new memory: a cudaMalloc, or pages mapped into an expandable segment ----
    def _grow(self, key: Hashable, size: int, small: bool, stream: str) -> Block:
        """A free block of at least `size` bytes, in the pool's index, from new memory (alloc_block). Over
        capacity, the cache is given back first (release_cached_blocks) and the search done again."""
        if not self.expandable:
            whole = segment_size(size)
            self._make_room(key, whole)
            return self._new_segment(whole, small, stream)
        start, need = self._expandable_room(size, small, stream)
        if self._over(need):
            self.empty_cache()
            start, need = self._expandable_room(size, small, stream)
            self._note_out_of_memory(key, need)
        if start is None:
            start = self._new_segment(self._address_space(small), small, stream, page_size(small))
        if not start.mapped:
            start = self._map(start, min(start.size, size))
        while start.size < size:  # free and mapped, then unmapped: map what is missing after it (merges with it)
            assert start.next is not None and not start.next.mapped
            start = self._map(start.next, min(size - start.size, start.next.size))
        return start

    def _over(self, nbytes: int) -> bool:
        return self.capacity is not None and self.reserved + nbytes > self.capacity

    def _make_room(self, key: Hashable, nbytes: int) -> None:
        if self._over(nbytes):
            self.empty_cache()
            self._note_out_of_memory(key, nbytes)

    def _note_out_of_memory(self, key: Hashable, nbytes: int) -> None:
        if self._over(nbytes) and self.out_of_memory is None:
            self.out_of_memory = key  # torch raises OutOfMemoryError here

    def _address_space(self, small: bool) -> int:
        space = ADDRESS_SPACE if self.capacity is None else self.capacity + self.capacity // 8
        return pages(space, page_size(small))

    def _expandable_room(self, size: int, small: bool, stream: str) -> tuple[Block | None, int]:
        """The lowest-addressed run of free and unmapped blocks of the pool's expandable segments with room for
        `size`, from the free block before an unmapped one, and the bytes of pages to map there
        (find_expandable_block); (None, pages of `size`) when a new segment is needed."""
        page = page_size(small)
        for seg, off in self.unmapped_index.get((small, stream), []):
            u = self.unmapped_blocks[(seg, off)]
            start = u.prev if u.prev is not None and not u.prev.allocated else u
            got = need = 0
            b: Block | None = start
            while got < size and b is not None and not b.allocated:
                take = b.size if b.mapped else min(b.size, pages(size - got, page))
                need += 0 if b.mapped else take
                got, b = got + take, b.next
            if got >= size:
                return start, need
        return None, pages(size, page)

    def _map(self, block: Block, nbytes: int) -> Block:
        """Map the pages of an unmapped block's first `nbytes` (map_block); the mapped part merges with free
        neighbours and is returned."""
        self._remove_unmapped(block)
        size = min(block.size, pages(nbytes, self.segments[block.segment].page))
        if size < block.size:
            self._insert_unmapped(self._split(block, size))
        block.mapped = True
        self.reserved += size
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        self._merge_free(block)
        return block

    def _new_segment(self, size: int, small: bool, stream: str, page: int = 0) -> Block:
        """cudaMalloc of `size` bytes (page 0), or an expandable segment's address space, nothing mapped."""
        n = self._next_segment
        self._next_segment += 1
        self.segments[n] = Segment(size, small, stream, page)
        block = self.heads[n] = Block(n, 0, size, mapped=page == 0)
        if page:
            self._insert_unmapped(block)
        else:
            self._insert_free(block)
            self.reserved += size
            self.peak_reserved = max(self.peak_reserved, self.reserved)
        return block

    # ---- giving memory back ----
    def empty_cache(self) -> None:
        """Give back what is cached (release_cached_blocks, as torch.cuda.empty_cache and malloc's last resort):
        every pending block first (the device synchronised), then the wholly free cudaMalloc segments and the whole
        pages inside free blocks of expandable segments (unmap_block); an expandable segment left with nothing
        mapped is released."""
        self.sync()
        for block in list(self.free_blocks.values()):
            if self._expandable(block):
                self._unmap(block)
            elif block.prev is None and block.next is None:
                self._remove_free(block)
                self.reserved -= self.segments.pop(block.segment).size
                del self.heads[block.segment]
                self.released += 1
        for seg, head in list(self.heads.items()):
            if not head.mapped and head.next is None:  # release_expandable_segment
                self._remove_unmapped(head)
                del self.segments[seg], self.heads[seg]

    def _unmap(self, block: Block) -> None:
        page = self.segments[block.segment].page
        lo, hi = pages(block.offset, page), block.offset + block.size
        hi -= hi % page
        if hi <= lo:
            return
        self._remove_free(block)
        if lo > block.offset:  # the free bytes before the first whole page stay mapped
            before, block = block, self._split(block, lo - block.offset)
            self._insert_free(before)
        if hi < block.offset + block.size:
            self._insert_free(self._split(block, hi - block.offset))
        block.mapped = False
        self.reserved -= block.size
        self.released += 1
        self._merge_unmapped(block)
