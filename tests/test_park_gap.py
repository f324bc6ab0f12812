"""`--gap` stops park's variants: once a plan is within the gap asked of the lower bound on every plan (computed here
independently of park), the variants left are not run, alone (xsched.solve.api) or as a member of a run; without a
gap asked, park runs every variant as before."""

from __future__ import annotations

import copy

import pytest

from xsched import zoo
from xsched.capture.torch import capture
from xsched.profiling.model import cost_profile
from xsched.solve import eager_peak, solve
from xsched.solve.heuristics import park
from xsched.solve.objective import objective, objective_floor
from xsched.solve.options import SolverOptions, enough_at, good_enough

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def problem():
    z = zoo.build("gpt2", scale="tiny")
    g = capture(copy.deepcopy(z.model), z.inputs, name="gpt2:tiny")
    prof = cost_profile(g, ["cpu:0"], stores=["cpu:1"])
    budgets = {"cpu:0": eager_peak(g) * 75 // 100, "cpu:1": 1 << 30}
    return g, prof, budgets


def variants_run(monkeypatch) -> list[int]:
    """Counts park's variants as they start (each builds one timeline)."""
    runs: list[int] = []
    line = park.park_line

    def counted(*args, **kwargs):
        runs.append(1)
        return line(*args, **kwargs)

    monkeypatch.setattr(park, "park_line", counted)
    return runs


def test_no_plan_is_good_enough_outside_a_run() -> None:
    assert not good_enough(0.0)
    with enough_at(1.5):
        assert good_enough(1.5) and not good_enough(1.6)
    assert not good_enough(-1e300)


@pytest.mark.parametrize("method", ["park", "auto"])
def test_a_gap_stops_park_within_it_of_the_bound(monkeypatch, problem, method: str) -> None:
    g, prof, budgets = problem
    devices = ["cpu:0", "cpu:1"]
    floor, _ = objective_floor(g, prof, devices, {v: "cpu:0" for v in g.inputs}, 0.0, budgets)
    assert floor > 0
    every = variants_run(monkeypatch)
    full = solve(g, prof, budgets, devices, "park", SolverOptions(time_limit_s=None))
    n_every = len(every)
    assert n_every > 1  # the gap has variants to save
    gap = 0.9  # as wide as it takes for park's first plan to be within it
    assert objective(full) <= floor / (1 - gap)
    stopped = variants_run(monkeypatch)
    plan = solve(g, prof, budgets, devices, method, SolverOptions(time_limit_s=None, mip_gap=gap))
    assert objective(plan) <= floor / (1 - gap)  # within the gap of the bound, as asked
    assert 1 <= len(stopped) < n_every
    if method == "park":
        assert len(stopped) == 1  # the first variant's plan is within it: nothing after it runs
