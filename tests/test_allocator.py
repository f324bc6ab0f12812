"""The caching-allocator model (xsched.allocator) against hand counts of PyTorch's rules, and its replay of plans."""

from __future__ import annotations

import pytest
from conftest import chain_graph
from hypothesis import given, settings
from hypothesis import strategies as st

from xsched.allocator import CachingAllocator, replay_reserved, reserved_range
from xsched.contracts.graph import Graph, Op, Value
from xsched.contracts.plan import Compute, Copy, Free, Plan, place_frees
from xsched.contracts.result import SolveResult
from xsched.simulate import simulate
from xsched.solve.reference import eager_plan

MiB = 1 << 20


def well_formed(m: CachingAllocator) -> None:
    """Every segment is tiled by its blocks, no two free mapped (or two unmapped) neighbours are left unmerged,
    unmapped blocks are whole pages, the indexes hold exactly the free and the unmapped blocks, and the counters are
    the sums they stand for (reserved: cudaMalloc'd segments and the mapped blocks of expandable ones)."""
    free, unmapped, reserved = set(), set(), 0
    for n, seg in m.segments.items():
        b, at, prev = m.heads[n], 0, None
        while b is not None:
            assert b.segment == n and b.offset == at and b.prev is prev and b.size > 0
            assert seg.page or b.mapped, "a cudaMalloc segment is mapped whole"
            if prev is not None and not b.allocated and not prev.allocated:
                assert b.mapped != prev.mapped, "free neighbours not merged"
            if not b.mapped:
                assert not b.allocated and b.offset % seg.page == 0 and b.size % seg.page == 0
                unmapped.add(id(b))
            elif not b.allocated:
                free.add(id(b))
            reserved += b.size if b.mapped else 0
            at, prev, b = at + b.size, b, b.next
        assert at == seg.size
    assert free == {id(b) for b in m.free_blocks.values()}
    assert unmapped == {id(b) for b in m.unmapped_blocks.values()}
    assert sum(len(v) for v in m.free_index.values()) == len(m.free_blocks)
    assert sum(len(v) for v in m.unmapped_index.values()) == len(m.unmapped_blocks)
    assert m.reserved == reserved
    assert m.allocated == sum(b.size for b in m.live.values())
    assert m.peak_reserved >= m.reserved and m.peak_allocated >= m.allocated


def test_sizes_round_to_512_bytes_and_small_requests_share_2_mib_segments() -> None:
    m = CachingAllocator()
    m.alloc("a", 1)  # 512 B
    m.alloc("b", 513)  # 1024 B, in the same 2 MiB segment
    m.alloc("none", 0)  # an empty tensor allocates nothing
    assert (m.live["a"].size, m.live["b"].size) == (512, 1024) and "none" not in m.live
    assert (m.allocated, m.reserved) == (1536, 2 * MiB)
    for k in range(3):  # 1536 B + 3 x 512 KiB leave 512 KiB - 1536 B: a fourth 512 KiB needs a new segment
        m.alloc(k, 512 << 10)
    assert m.reserved == 2 * MiB
    m.alloc(3, 512 << 10)
    assert m.reserved == 4 * MiB
    m.alloc("one", MiB)  # exactly 1 MiB is still small: the second segment has 1.5 MiB free
    assert m.reserved == 4 * MiB and m.live["one"].segment == 1
    fresh = CachingAllocator()
    fresh.alloc("one", MiB)  # with nothing cached, 1 MiB gets a small segment: 2 MiB, not 20
    assert fresh.reserved == 2 * MiB
    well_formed(m), well_formed(fresh)


def test_large_requests_use_20_mib_segments_below_10_mib_and_their_own_above() -> None:
    m = CachingAllocator()
    m.alloc("a", MiB + 1)  # large: 1 MiB + 512 B, carved from a 20 MiB segment
    assert (m.live["a"].size, m.reserved) == (MiB + 512, 20 * MiB)
    m.alloc("ten", 10 * MiB)  # best fit first: the 19 MiB - 512 B free tail takes it, and is split
    assert m.reserved == 20 * MiB and m.live["ten"].segment == 0
    m.alloc("big", 11 * MiB + 5)  # 11 MiB + 512 B: no free block fits (9 MiB - 512 B left), a 12 MiB segment,
    # whose 1 MiB - 512 B tail is not worth a split (a large block splits only above 1 MiB): allocated whole
    assert m.reserved == 32 * MiB and m.live["big"].size == 12 * MiB
    assert m.allocated == (MiB + 512) + 10 * MiB + 12 * MiB
    m.alloc("small", 100)  # the small pool never takes from large segments: a 2 MiB segment
    assert m.reserved == 34 * MiB
    well_formed(m)


def test_best_fit_splits_reuse_after_free_and_coalescing() -> None:
    m = CachingAllocator()
    for k in range(3):
        m.alloc(k, 4 * MiB)  # three 4 MiB blocks in one 20 MiB segment, 8 MiB left at its end
    assert m.reserved == 20 * MiB
    m.free(0), m.free(1)  # neighbours: they merge into one 8 MiB block at the segment's start
    assert sorted(b.size for b in m.free_blocks.values()) == [8 * MiB, 8 * MiB]
    m.alloc("eight", 8 * MiB)  # two 8 MiB blocks fit exactly: the lower address wins, nothing new
    assert m.reserved == 20 * MiB and m.live["eight"].offset == 0
    m.free("eight"), m.free(2)  # 8 + 4 + 8 MiB merge back into the whole segment
    assert [b.size for b in m.free_blocks.values()] == [20 * MiB]
    m.alloc("fifteen", 15 * MiB)  # fits only because of the merge
    assert m.reserved == 20 * MiB
    m.alloc("big", 11 * MiB)  # 5 MiB free: a 12 MiB segment of its own (11 MiB rounds up to 12)
    m.free("big")
    m.alloc("nine", 9 * MiB)  # best fit: the free 12 MiB segment, not the 5 MiB tail
    assert m.reserved == 32 * MiB and m.live["nine"].segment == 1
    m.alloc("frag", 4 * MiB)  # best fit: the 5 MiB tail (3 MiB is too small); 1 MiB left is not split off
    assert m.reserved == 32 * MiB and m.live["frag"].size == 5 * MiB and m.allocated == 15 * MiB + 9 * MiB + 5 * MiB
    m.alloc("more", 3 * MiB)  # the 3 MiB split off the 12 MiB segment fits exactly
    assert m.reserved == 32 * MiB and m.live["more"].segment == 1
    m.alloc("frag2", 2 * MiB)  # no free block is left anywhere: a new 20 MiB segment
    assert m.reserved == 52 * MiB and m.peak_allocated == 15 * MiB + 9 * MiB + 5 * MiB + 3 * MiB + 2 * MiB
    well_formed(m)


def test_a_block_freed_on_one_stream_is_not_reused_by_another() -> None:
    m = CachingAllocator()
    m.alloc("a", 4 * MiB)
    m.free("a")
    m.alloc("b", 4 * MiB, "copy:cpu->cuda:0")  # the compute stream's free 20 MiB is not the side stream's
    assert m.reserved == 40 * MiB
    m.alloc("c", 4 * MiB)  # the compute stream takes its own free block
    assert m.reserved == 40 * MiB and m.live["c"].segment == 0
    well_formed(m)


def test_a_block_another_stream_still_uses_waits_for_it_before_reuse_or_merge() -> None:
    m = CachingAllocator()
    m.alloc("a", 12 * MiB)  # a 12 MiB segment
    m.free("a", in_use_elsewhere=True)  # allocated drops at once, the block waits for the other stream
    assert (m.allocated, len(m.free_blocks)) == (0, 0)
    m.alloc("b", 12 * MiB)  # a's block is not free yet: a second segment
    assert m.reserved == 24 * MiB
    m.sync()
    m.alloc("c", 12 * MiB)  # now it is
    assert m.reserved == 24 * MiB and m.live["c"].segment == 0 and m.peak_allocated == 24 * MiB
    m.alloc("x", 4 * MiB), m.alloc("y", 4 * MiB)  # [0, 4) and [4, 8) MiB of a 20 MiB segment
    m.free("x", in_use_elsewhere=True)
    m.free("y")  # not merged with x while x waits: [4, 20) alone
    assert sorted(b.size for b in m.free_blocks.values()) == [16 * MiB]
    m.sync()  # x merges with it: the whole segment
    assert sorted(b.size for b in m.free_blocks.values()) == [20 * MiB]
    well_formed(m)


def test_over_capacity_free_segments_are_released_and_what_still_fails_is_named() -> None:
    m = CachingAllocator(capacity=40 * MiB)
    m.alloc("a", 12 * MiB)  # a 12 MiB segment
    m.alloc("s", 4 * MiB)  # a 20 MiB one, split: never released while part of it is in use
    m.free("a")
    m.alloc("b", 17 * MiB)  # no free block fits (12, 16 MiB); 32 + 18 > 40: the wholly free 12 MiB goes back
    assert (m.released, m.out_of_memory, m.reserved) == (1, None, 38 * MiB)
    m.alloc("c", 17 * MiB)  # 38 + 18 > 40 and no segment is wholly free: torch runs out of memory here
    assert (m.released, m.out_of_memory, m.reserved, m.peak_reserved) == (1, "c", 56 * MiB, 56 * MiB)
    well_formed(m)


def plan_of(g: Graph, steps, device: str = "cuda:0") -> Plan:
    return Plan(g.fingerprint, {}, {v: device for v in g.inputs}, tuple(steps), SolveResult("hand", "heuristic"))


def test_a_plan_replayed_by_hand() -> None:
    g = chain_graph([3 * MiB, 5 * MiB, 12 * MiB])  # x (8 B) -> a0 -> a1 -> a2
    plan = plan_of(g, [Compute("f0", "cuda:0"), Compute("f1", "cuda:0"), Free("a0", "cuda:0"), Compute("f2", "cuda:0")])
    r = replay_reserved(g, plan)["cuda:0"]
    # x: 512 B of a 2 MiB small segment. a0 [0, 3) and a1 [3, 8) MiB of a 20 MiB segment; a0 freed; a2 (12 MiB)
    # fits the free tail [8, 20) exactly: no new segment. Peak allocated at f2: 512 B + 5 + 12 MiB.
    assert (r.base_allocated, r.base_reserved, r.homed) == (512, 2 * MiB, 8)
    assert (r.reserved, r.allocated, r.plan_peak) == (22 * MiB, 17 * MiB + 512, 17 * MiB + 8)
    assert r.fragmentation == 5 * MiB - 512 and r.step_reserved == 20 * MiB and r.step_peak == 17 * MiB
    assert replay_reserved(g, plan, devices=[]) == {}  # a device not modelled: nothing


def test_a_value_copied_back_from_the_host_takes_a_block_of_its_copy_pools_stream() -> None:
    g = Graph(
        "park",
        (Value("x", 8, "input"), Value("a", 4 * MiB), Value("b", 4 * MiB), Value("y", 4 * MiB)),
        (Op("f", "t", ("x",), ("a",)), Op("g", "t", ("x",), ("b",)), Op("h", "t", ("a", "b"), ("y",))),
        ("y",),
    )
    d = "cuda:0"
    steps = [Compute("f", d), Copy("a", d, "cpu"), Free("a", d), Compute("g", d), Copy("a", "cpu", d)]
    plan = plan_of(g, [*steps, Free("a", "cpu"), Compute("h", d), Free("a", d), Free("b", d)])
    r = replay_reserved(g, plan)
    assert set(r) == {d}  # the host is not modelled
    # a [0, 4) MiB of a compute-stream segment, freed; b takes it again; a back from the host: the side stream's
    # own 20 MiB segment, though the compute stream's has 16 MiB free; y: the compute stream's [4, 8)
    assert r[d].reserved == 2 * MiB + 40 * MiB and r[d].allocated == 512 + 12 * MiB
    # the executor in plan order copies on the compute stream: a back at [4, 8) MiB, y at [8, 12), one segment
    assert replay_reserved(g, plan, side_streams=False)[d].reserved == 2 * MiB + 20 * MiB
    # copy_pool "compute": the side stream writes a block of the compute stream's pool: one segment again, with
    # the GPU keeping up or the host a step ahead (a's first block waits for its copy out, b takes [4, 8), a back
    # [8, 12), y [12, 16))
    for ahead in (False, True):
        assert replay_reserved(g, plan, copy_pool="compute", host_ahead=ahead)[d].reserved == 2 * MiB + 20 * MiB
    with pytest.raises(ValueError, match="copy_pool"):
        replay_reserved(g, plan, copy_pool="pinned")
    # parked on another GPU instead: the copy back is allocated on cuda:0's current (compute) stream, in its segment
    there = [Compute("f", d), Copy("a", d, "cuda:1"), Free("a", d), Compute("g", d), Copy("a", "cuda:1", d)]
    r = replay_reserved(g, plan_of(g, [*there, Free("a", "cuda:1"), Compute("h", d)]))
    assert set(r) == {d, "cuda:1"} and r[d].reserved == 2 * MiB + 20 * MiB and r["cuda:1"].reserved == 20 * MiB


def parked_plan() -> tuple[Graph, Plan]:
    """a (12 MiB) parked on the host and freed on the GPU, then b (12 MiB) computed there."""
    g = Graph(
        "ahead",
        (Value("x", 8, "input"), Value("a", 12 * MiB), Value("b", 12 * MiB), Value("y", 8)),
        (Op("f", "t", ("x",), ("a",)), Op("g", "t", ("x",), ("b",)), Op("h", "t", ("b",), ("y",))),
        ("y",),
    )
    d = "cuda:0"
    return g, plan_of(g, [Compute("f", d), Copy("a", d, "cpu"), Free("a", d), Compute("g", d), Compute("h", d)])


def test_a_parked_value_freed_before_its_copy_ends_holds_its_block_when_the_host_runs_ahead() -> None:
    g, plan = parked_plan()
    d = "cuda:0"
    assert reserved_range(g, plan)[d][0] == replay_reserved(g, plan)[d]
    # x and y share a 2 MiB small segment; a gets a 12 MiB segment, and b takes it again once a is freed ...
    assert replay_reserved(g, plan)[d].reserved == 14 * MiB
    # ... unless the copy lane's read of a (record_stream) may still be running: then b needs a 12 MiB of its own
    assert replay_reserved(g, plan, host_ahead=True)[d].reserved == 26 * MiB
    # in plan order the copy runs on the compute stream and the executor waits for it: nothing is pending
    assert replay_reserved(g, plan, host_ahead=True, side_streams=False)[d].reserved == 14 * MiB


def test_an_in_place_output_takes_its_input_block() -> None:
    g = chain_graph([4 * MiB, 4 * MiB])
    plan = plan_of(g, [Compute("f0", "cuda:0"), Compute("f1", "cuda:0"), Free("a0", "cuda:0")])
    assert replay_reserved(g, plan)["cuda:0"].allocated == 512 + 8 * MiB
    r = replay_reserved(g, plan, reuse={1: "a0"})["cuda:0"]  # f1 overwrites a0: one 4 MiB block for both
    assert (r.allocated, r.reserved, r.plan_peak) == (512 + 4 * MiB, 22 * MiB, 8 * MiB + 8)


# ---- never less reserved than allocated, nor allocated than the plan counts, on random plans ----
SIZES = [0, 100, 600 << 10, MiB, MiB + 1, 3 * MiB, 9 * MiB, 10 * MiB, 11 * MiB + 7, 25 * MiB]


@st.composite
def random_plans(draw) -> tuple[Graph, Plan]:
    n_in, n_ops = draw(st.integers(1, 2)), draw(st.integers(1, 8))
    values = [Value(f"in{i}", draw(st.sampled_from(SIZES)), "input") for i in range(n_in)]
    ops = []
    for k in range(n_ops):
        ins = draw(st.lists(st.sampled_from([v.id for v in values]), max_size=3, unique=True))
        outs = [Value(f"v{k}_{j}", draw(st.sampled_from(SIZES))) for j in range(draw(st.integers(1, 2)))]
        values += outs
        ops.append(
            Op(f"o{k}", "t", tuple(ins), tuple(v.id for v in outs), workspace_bytes=draw(st.sampled_from(SIZES)))
        )
    g = Graph("rand", tuple(values), tuple(ops), (values[-1].id,))
    if draw(st.booleans()):
        return g, eager_plan(g, "cuda:0")
    homes, steps, resident = {v: "cuda:0" for v in g.inputs}, [], {(v, "cuda:0") for v in g.inputs}
    for o in ops:  # each op on the GPU or the host, inputs copied where they are missing
        d = draw(st.sampled_from(["cuda:0", "cpu"]))
        for v in o.inputs:
            if (v, d) not in resident:
                steps.append(Copy(v, "cpu" if d == "cuda:0" else "cuda:0", d))
                resident.add((v, d))
        steps.append(Compute(o.id, d))
        resident |= {(v, d) for v in o.outputs}
    return g, Plan(g.fingerprint, {}, homes, place_frees(g, steps, homes), SolveResult("rand", "heuristic"))


@settings(max_examples=40, deadline=None)
@given(random_plans(), st.booleans())
def test_reserved_never_below_allocated_nor_allocated_below_the_plan_peak(gp, host_ahead) -> None:
    g, plan = gp
    r = replay_reserved(g, plan, host_ahead=host_ahead)["cuda:0"]
    # every value the plan counts gets a block of at least its size; every block lies in a segment
    assert r.reserved >= r.allocated >= simulate(g, plan).peak_bytes["cuda:0"] == r.plan_peak


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.sampled_from(SIZES), st.booleans(), st.booleans()), max_size=40))
def test_random_mallocs_and_frees_keep_the_segments_tiled_and_merged(ops) -> None:
    """Any sequence of allocations and frees, on two streams, some waiting for the other stream, keeps every
    invariant: blocks tile their segments, free neighbours are merged, the counters are the sums."""
    m = CachingAllocator(capacity=64 * MiB)
    for key, nbytes, side, elsewhere in ops:
        if key in m.live:
            m.free(key, in_use_elsewhere=elsewhere)
        else:
            m.alloc(key, nbytes, "side" if side else "compute")
        if elsewhere and side:
            m.sync()
        well_formed(m)
        assert m.reserved >= m.allocated + sum(b.size for b in m.pending)


def prefetch_plan(d: str = "cuda:0") -> tuple[Graph, Plan]:
    """A 12 MiB input copied in from the host, read, freed; then a 12 MiB value made on `d` and read."""
    g = Graph(
        "prefetch",
        (Value("a", 12 * MiB, "input"), Value("y", 8), Value("b", 12 * MiB), Value("z", 8)),
        (Op("f", "t", ("a",), ("y",)), Op("g", "t", ("y",), ("b",)), Op("h", "t", ("b",), ("z",))),
        ("z",),
    )
    steps = [Copy("a", "cpu", d), Compute("f", d), Free("a", d), Compute("g", d), Compute("h", d)]
    return g, Plan(g.fingerprint, {}, {"a": "cpu"}, tuple(steps), SolveResult("hand", "heuristic"))


def test_a_copied_in_value_takes_a_block_the_compute_stream_reuses_only_from_its_pool() -> None:
    d = "cuda:0"
    g, plan = prefetch_plan(d)
    # a: its own 12 MiB segment of the side stream's pool; y and z share a 2 MiB small segment; b: a 12 MiB
    # segment of the compute stream's pool, though a's is free
    assert replay_reserved(g, plan)[d].reserved == 26 * MiB
    # copy_pool "compute": a's segment is the compute stream's, and b takes it once a is freed ...
    assert replay_reserved(g, plan, copy_pool="compute")[d].reserved == 14 * MiB
    # ... unless the side stream's write may still run (record_stream(side)) with the host a step ahead
    assert replay_reserved(g, plan, copy_pool="compute", host_ahead=True)[d].reserved == 26 * MiB
