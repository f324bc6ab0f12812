"""The iterated greedy of planned addresses (xsched.allocator.arena_search): exact against exhaustive search over every
offset on tiny instances where greedy is not, offsets checked by the independent pairwise check, never above greedy,
and the same offsets on every run."""

from __future__ import annotations

import itertools

import pytest
from test_arena import disjoint, random_residencies

from xsched.allocator.addresses import _tops, best_greedy, cpsat_offsets, searched_offsets
from xsched.allocator.arena_search import improve, most_live, overlapping, place


def optimum(rs, size) -> int:
    """The smallest arena of any assignment: every offset (in 512 B units) of every residency tried."""
    best = None
    pairs = [(a, b) for a, b in itertools.combinations(rs, 2) if a.overlaps(b)]
    for offs in itertools.product(*[range(sum(size.values()) // 512 - size[r.key] // 512 + 1) for r in rs]):
        o = {r.key: 512 * x for r, x in zip(rs, offs)}
        top = max(o[r.key] + size[r.key] for r in rs)
        if (best is None or top < best) and all(
            o[a.key] + size[a.key] <= o[b.key] or o[b.key] + size[b.key] <= o[a.key] for a, b in pairs
        ):
            best = top
    assert best is not None
    return best


def top_of(rs, size, offsets) -> int:
    return max(offsets[r.key] + size[r.key] for r in rs)


# seeds of random_residencies(seed, 5, steps=6, units=3) where no greedy order reaches the optimum
GREEDY_ABOVE = (380, 396)


@pytest.mark.parametrize("seed", [*GREEDY_ABOVE, 0, 1, 2])
def test_the_search_finds_the_optimum_exhaustive_search_finds(seed: int) -> None:
    rs = random_residencies(seed, 5, steps=6, units=3)
    size = {r.key: r.nbytes for r in rs}
    best = optimum(rs, size)
    found = searched_offsets(rs, size)
    disjoint(rs, found, size)
    assert top_of(rs, size, found) == best
    if seed in GREEDY_ABOVE:
        assert top_of(rs, size, best_greedy(rs, size)) > best


def test_first_fit_in_the_order_of_an_optimum_s_offsets_reproduces_it() -> None:
    """The reason every order is enough: an optimal assignment, placed first fit in the order of its offsets."""
    rs = random_residencies(396, 5, steps=6, units=3)
    size = {r.key: r.nbytes for r in rs}
    solved, method = cpsat_offsets(rs, size, best_greedy(rs, size), 512, 10.0)
    assert method == "optimal"
    spans = [(r.start, r.end, size[r.key]) for r in rs]
    order = sorted(range(len(rs)), key=lambda k: solved[rs[k].key])
    placed = place(order, [n for *_, n in spans], overlapping(spans), tightest=False)
    assert max(o + n for o, (*_, n) in zip(placed, spans)) == top_of(rs, size, solved)


@pytest.mark.parametrize("seed", range(4))
def test_random_residencies_searched_never_overlap_nor_exceed_greedy(seed: int) -> None:
    rs = random_residencies(200 + seed, 60, steps=40, units=16)
    rs += [type(r)(r.value, "e", r.start, r.end, r.nbytes) for r in random_residencies(300 + seed, 40, 30, 8)]
    size = {r.key: r.nbytes for r in rs}
    found = searched_offsets(rs, size, work=300_000)
    disjoint(rs, found, size)
    greedy, searched = _tops(rs, size, best_greedy(rs, size)), _tops(rs, size, found)
    assert all(searched[d] <= greedy[d] for d in greedy)
    assert found == searched_offsets(rs, size, work=300_000)  # seeded: the executor and --explain place alike


def test_the_walk_stops_at_the_bound_and_keeps_its_best() -> None:
    """Three residencies live together at one step: 3 x 512 B is the bound, and any order meets it at once."""
    spans = [(0, 2, 512), (1, 3, 512), (2, 4, 512), (5, 6, 1024), (6, 8, 512), (7, 9, 512), (8, 8, 512)]
    assert most_live(spans) == 1536
    offsets, top = improve(spans, list(range(len(spans))))
    assert top == 1536 == max(o + n for o, (*_, n) in zip(offsets, spans))
