"""Iterated greedy for planned addresses: a residency that reaches the arena's top is moved to the front of the
placement order and every residency is placed again (first fit), a random walk over orders that keeps the smallest
arena it meets. Seeded and bounded by work (residency pairs looked at), not by wall time, so two runs on the same plan
(the executor's setup, `--explain`) place every value at the same offset.

First fit can reach every optimum: placed in the order of an optimal assignment's offsets, each residency lands at or
below its optimal offset (every residency placed before it and live with it ends at or below that offset, by
induction), so some order gives an arena no larger. Up to EXACT_UP_TO residencies every order is tried: exact.
"""

from __future__ import annotations

import itertools
import random
import time
from collections.abc import Sequence

Span = tuple[int, int, int]  # (first step, last step, bytes) of one residency

# pairs of residencies looked at over the whole search (each placement looks at the residencies live with it): 29
# rounds on the 541 residencies of GPT-2 (6 layers) at 55% on the GPU alone (whole steps), 49 on its 463 that `wrap`
# places; 0.2-0.5 s on the shared development machine (twice that did not find smaller arenas there)
SEARCH_WORK = 1_000_000
SEED = 0
EXACT_UP_TO = 6  # residencies (720 orders) for which every order is placed


def overlapping(spans: Sequence[Span]) -> list[list[int]]:
    """For each residency (by index), the indices of the others live at a common step with it."""
    by_start = sorted(range(len(spans)), key=lambda i: spans[i][0])
    out: list[list[int]] = [[] for _ in spans]
    for a, i in enumerate(by_start):
        for j in by_start[a + 1 :]:
            if spans[j][0] > spans[i][1]:
                break
            if spans[j][1] >= spans[i][0]:
                out[i].append(j)
                out[j].append(i)
    return out


def place(
    order: Sequence[int], nbytes: Sequence[int], near: Sequence[Sequence[int]], tightest: bool = True
) -> list[int]:
    """Offsets of residencies placed in `order`, each in the smallest gap (lowest first among equal ones) between the
    placed residencies live with it (`near`) that holds it, or without `tightest` in the lowest such gap; else above
    them all."""
    offset = [-1] * len(nbytes)
    end = [0] * len(nbytes)  # offset + bytes of each placed residency
    for i in order:
        n = nbytes[i]
        placed = [j for j in near[i] if offset[j] >= 0]
        placed.sort(key=offset.__getitem__)
        at, best, best_gap = 0, -1, 0  # at: the lowest byte above every placed slot below the gap being looked at
        for j in placed:
            gap = offset[j] - at
            if gap >= n and (best < 0 or gap < best_gap):
                best, best_gap = at, gap
                if not tightest:
                    break
            if end[j] > at:
                at = end[j]
        offset[i] = best if best >= 0 else at
        end[i] = offset[i] + n
    return offset


def improve(
    spans: Sequence[Span],
    order: Sequence[int],
    near: Sequence[Sequence[int]] | None = None,
    *,
    work: int = SEARCH_WORK,
    seed: int = SEED,
    deadline: float | None = None,
) -> tuple[list[int], int]:
    """The smallest arena met by the walk from `order` (indices into `spans`, one device's residencies; `near`:
    overlapping's, when made) and its top: each round moves one residency that reaches the current top (chosen at
    random) to the front of the order and places all again, first fit. Rounds stop when `work` pairs were looked at,
    the top meets the most bytes live at one step (no arena is smaller), or at `deadline` (time.perf_counter()) where
    one is given. Up to EXACT_UP_TO residencies: the best of every order instead (the optimum)."""
    nbytes = [n for _, _, n in spans]
    near = near if near is not None else overlapping(spans)
    if len(spans) <= EXACT_UP_TO:
        return _every_order(nbytes, near)
    per_round = len(spans) + sum(map(len, near)) // 2
    rounds = work // max(per_round, 1)
    floor = most_live(spans)
    rng = random.Random(seed)
    current = list(order)
    offset = place(current, nbytes, near, tightest=False)
    top = max((o + n for o, n in zip(offset, nbytes)), default=0)
    best, best_top = offset, top
    for _ in range(rounds):
        if best_top <= floor or (deadline is not None and time.perf_counter() > deadline):
            break
        i = rng.choice([k for k, (o, n) in enumerate(zip(offset, nbytes)) if o + n == top])
        current.remove(i)
        current.insert(0, i)
        offset = place(current, nbytes, near, tightest=False)
        top = max(o + n for o, n in zip(offset, nbytes))
        if top < best_top:
            best, best_top = offset, top
    return best, best_top


def _every_order(nbytes: Sequence[int], near: Sequence[Sequence[int]]) -> tuple[list[int], int]:
    """First fit over every order: the smallest arena any assignment has (the module's docstring says why)."""
    best: list[int] = []
    best_top = -1
    for order in itertools.permutations(range(len(nbytes))):
        offset = place(order, nbytes, near, tightest=False)
        top = max(o + n for o, n in zip(offset, nbytes))
        if best_top < 0 or top < best_top:
            best, best_top = offset, top
    return best, max(best_top, 0)


def most_live(spans: Sequence[Span]) -> int:
    """The most bytes live at one step: no arena is smaller."""
    events = sorted([(s, n) for s, _, n in spans] + [(e + 1, -n) for _, e, n in spans])
    live = most = 0
    for _, d in events:
        live += d
        most = max(most, live)
    return most
