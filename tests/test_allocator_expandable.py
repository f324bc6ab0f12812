"""The caching-allocator model with expandable segments (xsched.allocator.caching, expandable=True) against hand
counts of PyTorch's rules: pages mapped as a stream's one segment grows, best fit that prefers blocks that cannot
grow, pages given back only by empty_cache or a failed allocation, and plans replayed with the setting."""

from __future__ import annotations

from conftest import chain_graph
from hypothesis import given, settings
from hypothesis import strategies as st
from test_allocator import SIZES, plan_of, prefetch_plan, random_plans, well_formed

from xsched.allocator import CachingAllocator, replay_reserved, reserved_range
from xsched.contracts.graph import Graph, Op, Value
from xsched.contracts.plan import Compute, Free
from xsched.simulate import simulate

MiB = 1 << 20


def test_each_pool_of_each_stream_grows_one_segment_by_whole_pages() -> None:
    m = CachingAllocator(expandable=True)
    m.alloc("a", 1)  # the small pool's segment: one 2 MiB page mapped
    m.alloc("b", 3 * MiB)  # the large pool's: one 20 MiB page; b at [0, 3) MiB
    assert (m.reserved, len(m.segments)) == (22 * MiB, 2)
    m.alloc("c", 12 * MiB)  # best fit: [3, 15) of the page
    assert m.reserved == 22 * MiB and m.live["c"].offset == 3 * MiB
    m.alloc("d", 12 * MiB)  # [15, 20) is free, 7 MiB more are needed: one more page, [20, 40); d at [15, 27)
    assert (m.reserved, m.live["d"].offset, len(m.segments)) == (42 * MiB, 15 * MiB, 2)
    m.free("b"), m.free("c")  # [0, 15) free, merged across what were two segments before
    m.alloc("e", 14 * MiB)  # fits there; the 1 MiB left is split off (expandable: any rest of 512 B or more)
    assert m.reserved == 42 * MiB and m.live["e"].offset == 0 and m.live["e"].size == 14 * MiB
    m.alloc("s", 4 * MiB, "side")  # another stream: its own segment and page, though [27, 40) is free
    assert (m.reserved, len(m.segments)) == (62 * MiB, 3)
    m.free("d"), m.free("e")  # pages stay mapped: reserved is given back only by empty_cache
    assert (m.reserved, m.peak_reserved, m.allocated) == (62 * MiB, 62 * MiB, 512 + 4 * MiB)
    well_formed(m)
    default = CachingAllocator()
    for key, nbytes in (("a", 1), ("b", 3 * MiB), ("c", 12 * MiB), ("d", 12 * MiB)):
        default.alloc(key, nbytes)
    # the same best fit; d gets a 12 MiB cudaMalloc where expandable maps a 20 MiB page
    assert default.reserved == 2 * MiB + 20 * MiB + 12 * MiB


def test_best_fit_takes_the_free_end_of_a_segment_only_when_no_other_block_fits() -> None:
    m = CachingAllocator(expandable=True)
    for key, nbytes in (("x", 4 * MiB), ("y", 10 * MiB), ("z", 4 * MiB)):
        m.alloc(key, nbytes)  # x [0, 4), y [4, 14), z [14, 18), free [18, 20) before the unmapped rest
    m.free("y")
    m.alloc("w", 2 * MiB)  # the 2 MiB end fits exactly, but it could grow: the 10 MiB block inside is taken
    assert m.live["w"].offset == 4 * MiB
    m.alloc("v", 2 * MiB)  # [6, 14) inside still fits: taken again
    assert m.live["v"].offset == 6 * MiB
    m.alloc("u", 7 * MiB)  # nothing inside fits now ([8, 14) is 6 MiB): the end [18, 20) grows by a page
    assert (m.live["u"].offset, m.reserved) == (18 * MiB, 40 * MiB)
    well_formed(m)
    default = CachingAllocator()  # the default rules take the exact fit at the end
    for key, nbytes in (("x", 4 * MiB), ("y", 10 * MiB), ("z", 4 * MiB)):
        default.alloc(key, nbytes)
    default.free("y")
    default.alloc("w", 2 * MiB)
    assert default.live["w"].offset == 18 * MiB


def test_empty_cache_unmaps_whole_free_pages_and_the_hole_is_filled_first() -> None:
    m = CachingAllocator(expandable=True)
    for key in "abc":
        m.alloc(key, 20 * MiB)  # one page each: [0, 20), [20, 40), [40, 60)
    m.free("b")
    m.empty_cache()  # [20, 40) is a whole free page: unmapped
    assert (m.reserved, m.released) == (40 * MiB, 1)
    m.alloc("d", 10 * MiB)  # the lowest unmapped range with room: the hole, mapped again
    assert (m.live["d"].offset, m.reserved) == (20 * MiB, 60 * MiB)
    m.alloc("e", 15 * MiB)  # [30, 40) is too small: the end grows, [60, 80)
    assert (m.live["e"].offset, m.reserved) == (60 * MiB, 80 * MiB)
    m.free("a"), m.free("c"), m.free("d"), m.free("e")
    m.empty_cache()  # nothing is left mapped: the segment is released
    assert (m.reserved, m.segments) == (0, {})
    well_formed(m)


def test_over_capacity_the_free_pages_of_every_stream_are_unmapped_and_the_request_retried() -> None:
    m = CachingAllocator(capacity=64 * MiB, expandable=True)
    m.alloc("a", 30 * MiB)  # compute: two pages, [0, 40)
    m.alloc("s", 4 * MiB, "side")  # side: one page
    m.free("a")
    m.alloc("b", 30 * MiB, "side")  # [4, 20) free + one more page: 80 MiB > 64; the compute stream's two free pages
    assert (m.reserved, m.released, m.out_of_memory) == (40 * MiB, 1, None)  # are unmapped first, then it fits
    assert m.live["b"].offset == 4 * MiB
    m.alloc("c", 50 * MiB)  # three pages: 100 MiB > 64 even with nothing cached: out of memory
    assert (m.out_of_memory, m.reserved) == ("c", 100 * MiB)
    well_formed(m)


def test_segments_keep_their_kind_when_the_setting_changes() -> None:
    m = CachingAllocator()
    m.alloc("p", 4 * MiB)  # a 20 MiB cudaMalloc segment, [4, 20) free
    m.expandable = True
    m.alloc("q", 8 * MiB)  # the cudaMalloc segment's free block is found as before: [4, 12)
    assert (m.live["q"].segment, m.reserved) == (0, 20 * MiB)
    m.alloc("r", 7 * MiB + 512 * 1024)  # 512 KiB left: split with the setting on (the default hands out 8 MiB)
    assert m.live["r"].size == 7 * MiB + 512 * 1024
    m.alloc("t", 12 * MiB)  # new memory is an expandable segment's page
    assert (m.live["t"].segment, m.reserved, m.segments[1].page) == (1, 40 * MiB, 20 * MiB)
    m.free("t")
    m.expandable = False
    m.alloc("u", 4 * MiB)  # the setting off: the free expandable page is passed over, a cudaMalloc segment made
    assert (m.live["u"].segment, m.reserved) == (2, 60 * MiB)
    well_formed(m)


def merge_graph() -> Graph:
    """a and b (11 MiB each) made and freed, then c (21 MiB): freed neighbours that only expandable segments merge."""
    return Graph(
        "merge",
        (Value("x", 8, "input"), Value("a", 11 * MiB), Value("b", 11 * MiB), Value("s", 8), Value("c", 21 * MiB))
        + (Value("y", 8),),
        (
            Op("f", "t", ("x",), ("a",)),
            Op("g", "t", ("a",), ("b",)),
            Op("k", "t", ("b",), ("s",)),
            Op("h", "t", ("x",), ("c",)),
            Op("m", "t", ("s", "c"), ("y",)),
        ),
        ("y",),
    )


def test_a_plan_replayed_with_expandable_segments_by_hand() -> None:
    g = merge_graph()
    d = "cuda:0"
    plan = plan_of(
        g,
        [Compute("f", d), Compute("g", d), Free("a", d), Compute("k", d), Free("b", d), Compute("h", d)]
        + [Compute("m", d), Free("s", d), Free("c", d)],
    )
    # default: a and b a 12 MiB segment each, c (21 MiB) a 22 MiB one though both are free; x, s, y share 2 MiB
    assert replay_reserved(g, plan)[d].reserved == (2 + 12 + 12 + 22) * MiB
    # expandable: a [0, 11), b [11, 22) over two pages; freed, they merge and c takes [0, 21): 40 MiB
    r = replay_reserved(g, plan, expandable=True)[d]
    assert (r.reserved, r.base_reserved, r.step_reserved, r.expandable) == (42 * MiB, 2 * MiB, 40 * MiB, True)
    # a chain whose freed block lies between two live ones: the page rounding costs more than the default's
    chain = chain_graph([11 * MiB, 11 * MiB, 21 * MiB])
    steps = [Compute("f0", d), Compute("f1", d), Free("a0", d), Compute("f2", d)]
    assert replay_reserved(chain, plan_of(chain, steps))[d].reserved == (2 + 12 + 12 + 22) * MiB
    assert replay_reserved(chain, plan_of(chain, steps), expandable=True)[d].reserved == (2 + 60) * MiB


def test_a_copied_in_value_grows_the_side_streams_own_segment() -> None:
    d = "cuda:0"
    g, plan = prefetch_plan(d)
    # a: one 20 MiB page of the side stream's segment; y, z: a small page; b: a page of the compute stream's
    low, high = reserved_range(g, plan, expandable=True)[d]
    assert (low.reserved, high.reserved) == (42 * MiB, 42 * MiB)
    # copy_pool "compute": a's page is the compute stream's and b takes it again, unless the host runs ahead
    low, high = reserved_range(g, plan, copy_pool="compute", expandable=True)[d]
    assert (low.reserved, high.reserved) == (22 * MiB, 42 * MiB)


@settings(max_examples=40, deadline=None)
@given(random_plans(), st.booleans())
def test_expandable_reserved_never_below_allocated_nor_allocated_below_the_plan_peak(gp, host_ahead) -> None:
    g, plan = gp
    r = replay_reserved(g, plan, host_ahead=host_ahead, expandable=True)["cuda:0"]
    assert r.reserved >= r.allocated >= simulate(g, plan).peak_bytes["cuda:0"] == r.plan_peak


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 5), st.sampled_from(SIZES), st.booleans(), st.booleans()), max_size=40),
    st.lists(st.booleans(), min_size=40, max_size=40),
)
def test_random_mallocs_frees_and_releases_keep_expandable_segments_tiled_and_merged(ops, flips) -> None:
    """Any sequence of allocations, frees, cache releases and setting changes, on two streams, under a capacity,
    keeps every invariant."""
    m = CachingAllocator(capacity=64 * MiB, expandable=True)
    for (key, nbytes, side, elsewhere), flip in zip(ops, flips):
        if key in m.live:
            m.free(key, in_use_elsewhere=elsewhere)
        else:
            m.alloc(key, nbytes, "side" if side else "compute")
        if flip and elsewhere:
            m.empty_cache()
        elif flip:
            m.expandable = not m.expandable
        well_formed(m)
        assert m.reserved >= m.allocated + sum(b.size for b in m.pending)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.sampled_from(SIZES[1:]), max_size=30))
def test_without_frees_each_pool_holds_its_blocks_end_to_end_in_whole_pages(sizes) -> None:
    """Nothing freed: every block lands at the end of its pool's segment, so each pool reserves its rounded sizes'
    sum rounded up to its page (2 MiB small, 20 MiB large), counted here apart from the model's own arithmetic."""
    m = CachingAllocator(expandable=True)
    small = large = 0
    for k, nbytes in enumerate(sizes):
        m.alloc(k, nbytes)
        rounded = -(-nbytes // 512) * 512
        small, large = (small + rounded, large) if rounded <= MiB else (small, large + rounded)
    assert m.reserved == -(-small // (2 * MiB)) * 2 * MiB + -(-large // (20 * MiB)) * 20 * MiB
    assert m.allocated == small + large
    well_formed(m)
