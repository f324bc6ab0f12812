"""The optimizer split by predicted step time: the host's AdamW modelled as one worker that updates each group of
parameters once the backward has released it, taking first the group the next forward reads first, and the next
forward waiting for each group it reads until its update is done; a group moved to the computing device is updated
there instead, which adds its update to that device's step. The split minimises the predicted step within the bytes
the device can give: a greedy choice by gain per byte, then swaps while one helps."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Collection, Sequence
from dataclasses import dataclass

EPS = 1e-12


@dataclass(frozen=True)
class Group:
    """Parameters moved or kept together: their graph input ids, elements, the device bytes they take when moved
    (weights, gradients and optimizer state), when the backward releases them (s from the step's start) and when
    the next forward first reads them (s from its start)."""

    params: tuple[str, ...]
    numel: int
    bytes: int
    release_s: float
    read_s: float


@dataclass(frozen=True)
class StepModel:
    """The plan's forward and backward (s), and the AdamW rates (parameters/s) on the host and on the device."""

    run_s: float
    host_rate: float
    device_rate: float


def predict_step(groups: Sequence[Group], moved: Collection[int], model: StepModel) -> tuple[float, float]:
    """The predicted step (s) with the groups `moved` (indices) updated on the device, and the host's lateness
    summed over the groups (a tie-breaker: how far the split is from hiding the host update)."""
    kept = sorted((g.release_s, g.read_s, i) for i, g in enumerate(groups) if i not in moved)
    ready: list[tuple[float, float, int]] = []
    t, k, late, total = 0.0, 0, 0.0, 0.0
    while k < len(kept) or ready:
        if not ready:
            t = max(t, kept[k][0])
        while k < len(kept) and kept[k][0] <= t:
            heapq.heappush(ready, (kept[k][1], kept[k][0], kept[k][2]))
            k += 1
        read_s, _, i = heapq.heappop(ready)
        t += groups[i].numel / model.host_rate
        lateness = t - model.run_s - read_s
        late = max(late, lateness)
        total += max(0.0, lateness)
    device = sum(groups[i].numel for i in moved) / model.device_rate
    return model.run_s + late + device, total


def choose_groups(groups: Sequence[Group], model: StepModel, allowance: int) -> frozenset[int]:
    """The groups to move (within `allowance` bytes) that minimise the predicted step: two greedy choices (by gain
    per byte, and by gain), each improved by exchanges (up to two moved groups out, one kept group in) while one
    helps; the better of the two."""
    found = [
        _exchange(groups, model, allowance, _greedy(groups, model, allowance, per_byte)) for per_byte in (True, False)
    ]
    return frozenset(min(found, key=lambda m: (predict_step(groups, m, model), sorted(m))))


def _greedy(groups: Sequence[Group], model: StepModel, allowance: int, per_byte: bool) -> set[int]:
    """Groups added one at a time, the one with the largest gain (per byte, or in all) first, while one helps."""
    moved: set[int] = set()
    best = predict_step(groups, moved, model)
    used = 0
    while True:
        pick, pick_key = None, None
        for i, g in enumerate(groups):
            if i in moved or used + g.bytes > allowance:
                continue
            value = predict_step(groups, moved | {i}, model)
            if not value < best:
                continue
            gain = best[0] - value[0]
            key = (-(gain / max(1, g.bytes) if per_byte else gain), value)
            if pick_key is None or key < pick_key:
                pick, pick_key = i, key
        if pick is None or pick_key is None:
            return moved
        moved.add(pick)
        used += groups[pick].bytes
        best = pick_key[1]


def _exchange(groups: Sequence[Group], model: StepModel, allowance: int, moved: set[int]) -> set[int]:
    """The best exchange of up to two moved groups for up to one kept group, repeated while it lowers the
    prediction."""
    best = predict_step(groups, moved, model)
    while True:
        used = sum(groups[i].bytes for i in moved)
        change, value = None, best
        outs = [(), *((i,) for i in sorted(moved)), *itertools.combinations(sorted(moved), 2)]
        for out in outs:
            room = allowance - used + sum(groups[i].bytes for i in out)
            for into in [None, *(i for i in range(len(groups)) if i not in moved)]:
                if (not out and into is None) or (into is not None and groups[into].bytes > room):
                    continue
                trial = (moved - set(out)) | ({into} if into is not None else set())
                v = predict_step(groups, trial, model)
                if v < value:
                    change, value = trial, v
        if change is None:
            return moved
        moved, best = change, value
