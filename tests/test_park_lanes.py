"""The park greedy's incremental bookkeeping against its definitions: a lane's finish times after one insert equal a
full recount, the copy back's position equals a scan of every candidate, and park_remat, which skips the variants
that can only repeat a plan, picks the plan the full sweep of variants picks."""

from __future__ import annotations

import random

import numpy as np
import pytest
from executor_support import workload
from test_offload import fwd_bwd
from test_park import with_store

from xsched.contracts.profile import LinkCost, Profile
from xsched.errors import BudgetError
from xsched.solve.heuristics import park as park_mod
from xsched.solve.heuristics.park import park_pairs, park_remat, park_variant
from xsched.solve.heuristics.park_lane import Lane
from xsched.solve.heuristics.park_model import ParkTimeline
from xsched.solve.objective import best_of
from xsched.solve.order.order import starting_orders
from xsched.solve.problem import Problem
from xsched.solve.reference import eager_peak

DEVICES = ("cpu:0", "cpu:1")


def store_profile(graph, op_s: float = 1e-3, latency: float = 1e-4, bandwidth: float = 3e7) -> Profile:
    """test_park's cpu:0-computes, cpu:1-stores profile, at this file's op time and link."""
    return with_store(graph, op_s, latency, bandwidth)


def test_a_lane_after_one_insert_finishes_as_a_full_recount_says() -> None:
    rng = random.Random(7)
    start = np.cumsum([0.0] + [rng.uniform(0.1, 1.0) for _ in range(40)])
    lane, done = Lane([]), []
    for _ in range(60):
        emit = rng.randrange(40)
        item = (emit, emit + rng.randrange(2), rng.uniform(0.01, 2.0), min(40, emit + 1 + rng.randrange(5)))
        done = lane.added(start, done, item)
        prev, recount = 0.0, []
        for _, ready, secs, _ in lane.items:  # the definition: one copy after another, each once it is ready
            prev = max(float(start[ready]), prev) + secs
            recount.append(prev)
        assert done == recount
        assert lane.emits == sorted(lane.emits)


def scanned_back(line: ParkTimeline, t: int, b: int, secs: float) -> tuple[int, float, int, float]:
    """The copy back's position by its definition, every candidate tried: the latest p in (t, b) done by b's start,
    else t + 1 and its lateness."""
    lane, done, start = line.lanes["in"], line.done["in"], line.start

    def finish(p: int) -> tuple[int, float]:
        at = sum(e <= p for e in lane.emits)
        return at, max(float(start[p]), done[at - 1] if at else 0.0) + secs

    fits = [p for p in range(t + 1, b) if finish(p)[1] <= start[b]]
    p = max(fits) if fits else t + 1
    at, f = finish(p)
    return p, (0.0 if fits else max(0.0, f - float(start[b]))), at, f


def test_the_copy_back_goes_where_a_scan_of_every_position_puts_it() -> None:
    """gpt2 (tiny) with its weights on the store: the in lane holds their fetches; for many (peak, next read, copy
    time) the position found on the precomputed ready times is the scan's, exactly."""
    _, graph = workload("gpt2")
    profile = store_profile(graph)
    homes = {v: ("cpu:1" if v.startswith(("param:", "buffer:")) else "cpu:0") for v in graph.inputs}
    order = range(len(graph.ops))
    line = ParkTimeline(graph, order, "cpu:0", profile, "cpu:1", *_links(profile), homes)
    assert len(line.lanes["in"].items) > 10  # the weights' fetches are queued: the lane is not empty
    rng = random.Random(3)
    n = len(line.ops)
    for _ in range(300):
        t = rng.randrange(-1, n - 2)
        b = rng.randrange(t + 1, n)
        secs = rng.choice([0.0, 1e-4, 1e-3, 5e-3, 0.05])
        assert line._back(t, b, secs) == scanned_back(line, t, b, secs)


def _links(profile: Profile) -> tuple[LinkCost, LinkCost]:
    return profile.link("cpu:0", "cpu:1"), profile.link("cpu:1", "cpu:0")


def every_variant(problem: Problem):
    """The plan of the full sweep: every (pair, order, depth, price) variant run, the best kept."""
    plans = []
    for c, store in park_pairs(problem.graph, problem.profile, problem.devices):
        for name, order in starting_orders(problem.graph).items():
            for depth in (0, park_mod.MAX_DEPTH):
                for price in park_mod.PRICES:
                    try:
                        plans.append(
                            park_variant(
                                problem.graph, problem.profile, problem.budgets, problem.homes,
                                c, store, name, order, depth, price, 1.0, 0.0,
                            )
                        )  # fmt: skip
                    except BudgetError:
                        pass
    return best_of(plans, 0.0) if plans else None


@pytest.mark.parametrize("share, bandwidth", [(2.0, 2e6), (0.6, 2e6), (0.5, 5e5), (0.3, 2e6)])
def test_park_remat_picks_the_plan_of_the_full_sweep(share: float, bandwidth: float) -> None:
    """A chain's training graph, its input on the store, at budgets where the order fits as it is (the skipped
    variants could only repeat it), where parks (and, over a slower link, reruns) are needed, and below what any
    variant reaches: the same steps as running every variant, or no plan either way."""
    graph = fwd_bwd(8, size=1000)
    profile = store_profile(graph, bandwidth=bandwidth)
    problem = Problem(graph, profile, {"cpu:0": int(share * eager_peak(graph))}, list(DEVICES), {"x": "cpu:1"})
    expected = every_variant(problem)
    if expected is None:
        with pytest.raises(BudgetError):
            park_remat(problem)
        return
    plan = park_remat(problem)
    assert plan.steps == expected.steps
    if share >= 1.0:
        assert plan.solver.stats.parked == 0 and plan.solver.stats.recomputes == 0
    else:
        assert plan.solver.stats.parked + plan.solver.stats.recomputes > 0


class NoNoise(random.Random):
    """A jitter stream that always draws 0: every score exactly as unjittered, but the greedy cannot stop early."""

    def random(self) -> float:
        return 0.0


@pytest.mark.parametrize("share, price, depth", [(0.5, 0.0, 0), (0.3, 0.1, 4), (0.3, 0.0, 4), (0.5, None, 4)])
def test_skipping_values_that_cannot_win_changes_no_choice(share: float, price: float | None, depth: int) -> None:
    """gpt2 (tiny), weights on the store: the greedy skips values whose score floor is no better than the best so
    far and stops at a score of 0; the full scan (forced by a jitter that adds nothing) makes the same moves, in the
    same order, with each link price (0: free parks end the scan; None: reruns only) and rerun depth."""
    _, graph = workload("gpt2")
    profile = store_profile(graph, bandwidth=3e8)
    homes = {v: ("cpu:1" if v.startswith(("param:", "buffer:")) else "cpu:0") for v in graph.inputs}
    budget = int(share * eager_peak(graph))
    order = next(iter(starting_orders(graph).values()))
    args = (graph, order, "cpu:0", "cpu:1", budget, profile, homes, depth, price)
    fast, full = park_mod.park_computes(*args), park_mod.park_computes(*args, NoNoise())
    assert fast.parks or any(fast.redo.values())  # moves were made: the case the skipping is for
    assert fast.parks == full.parks and fast.redo == full.redo and fast.end_redo == full.end_redo
    assert fast.spans == full.spans


SAME_PLAN = """
import hashlib
from xsched.contracts.graph import Graph, Op, Value
from xsched.contracts.profile import DeviceInfo, LinkCost, OpCost, Profile
from xsched.solve.heuristics.park import park_remat
from xsched.solve.problem import Problem
ws = [f"w{k}" for k in range(12)]  # weights on the store, first read together: their fetches tie on position
values = [Value("x", 100, "input"), *(Value(w, 100 + k, "input") for k, w in enumerate(ws))]
values += [Value("h", 100), Value("y", 100), Value("g", 100)]
ops = (Op("f", "t", ("x", *ws), ("h",)), Op("f2", "t", ("h", *ws[:6]), ("y",)), Op("b", "t", ("y", "h", *ws), ("g",), "bwd"))
g = Graph("tie", tuple(values), ops, ("g",))
link = LinkCost(1e-4, 1e6)
profile = Profile(g.fingerprint, {d: DeviceInfo("cpu") for d in ("cpu:0", "cpu:1")},
                  {"cpu:0": {o.id: OpCost(1e-3) for o in ops}, "cpu:1": {}}, {"cpu:0->cpu:1": link, "cpu:1->cpu:0": link})
homes = {"x": "cpu:0"} | {w: "cpu:1" for w in ws}
plan = park_remat(Problem(g, profile, {"cpu:0": 4000}, ["cpu:0", "cpu:1"], homes))
print(hashlib.sha256(repr(plan.steps).encode()).hexdigest())
"""


def test_the_plan_does_not_depend_on_the_hash_seed() -> None:
    """Weights on the store first read by one op: their fetches are ordered by name on the tie, so two processes
    with different string hashes (set orders) make the same plan (a cached plan is what a fresh solve gives)."""
    import os
    import subprocess
    import sys

    out = set()
    for seed in ("1", "2", "3"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        run = subprocess.run([sys.executable, "-c", SAME_PLAN], env=env, capture_output=True, text=True, check=True)
        out.add(run.stdout.strip())
    assert len(out) == 1
