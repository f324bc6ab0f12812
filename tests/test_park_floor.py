"""Park's greedy skips the candidates whose score floors (`park_floor.Floors`) cannot beat its best so far: each move
it makes is the one an exhaustive scan of every candidate (each scored, nothing skipped) picks, ties included."""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest

from xsched import zoo
from xsched.capture.torch import capture
from xsched.profiling.model import cost_profile
from xsched.solve import eager_peak
from xsched.solve.heuristics import park
from xsched.solve.heuristics.gaps import MAX_DEPTH
from xsched.solve.order.order import starting_orders

pytestmark = pytest.mark.usefixtures("one_thread")


def same_move(a, b) -> bool:
    """Two moves equal field by field (a drop's or an end rerun's byte changes compared as arrays)."""
    if type(a) is not type(b):
        return False
    if a is None:
        return True
    return all(
        np.array_equal(x, y) if isinstance(x, np.ndarray) else x == y
        for x, y in ((getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a))
    )


@pytest.mark.parametrize("pct", [70, 50])
def test_each_move_is_the_exhaustive_scans(monkeypatch, pct: int) -> None:
    z = zoo.build("gpt2", scale="tiny")
    g = capture(copy.deepcopy(z.model), z.inputs, name="gpt2:tiny")
    prof = cost_profile(g, ["cpu:0"], stores=["cpu:1"])
    homes = {v: "cpu:0" for v in g.inputs}
    budget = eager_peak(g) * pct // 100
    pruned, kinds = park._best_move, set()

    def checked(line, t, budget, depth, price, cost, noise, exact, floors=None, keep_leaving=False):
        move = pruned(line, t, budget, depth, price, cost, noise, exact, floors, keep_leaving)
        # unjittered but not `exact`: every candidate scored, each score times 1.0, the least (score, rank) kept
        full = pruned(line, t, budget, depth, price, cost, lambda: 1.0, exact=False, keep_leaving=keep_leaving)
        assert same_move(move, full)
        kinds.add(type(move).__name__)
        return move

    monkeypatch.setattr(park, "_best_move", checked)
    order = next(iter(starting_orders(g).values()))
    for depth in (0, MAX_DEPTH):
        for price in park.PRICES:
            try:
                park.park_computes(g, order, "cpu:0", "cpu:1", budget, prof, homes, depth, price)
            except park.BudgetError:
                pass  # (nothing lowers a peak: the moves up to there were checked)
    assert {"Drop", "Park"} <= kinds, kinds  # both kinds were chosen somewhere, each checked
