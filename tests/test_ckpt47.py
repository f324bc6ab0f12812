"""The runner's time for its first search while no plan is found (runner.NO_PLAN_SHARE), on a fake clock; and the
H100 graphs and profiles of 2026-11-27 in benchmarks/gpu belong together."""

from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path

import pytest
from test_time_limit import FakeClock, problem

from xsched.contracts.graph import Graph
from xsched.contracts.profile import Profile
from xsched.contracts.result import SolveResult
from xsched.errors import BudgetError
from xsched.solve import registry, runner
from xsched.solve.options import SolverOptions, using_clock
from xsched.solve.problem import Outcome
from xsched.solve.runner import Configuration, run

GPU = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu"
_spec = importlib.util.spec_from_file_location(
    "bench_h100_budgets", Path(__file__).resolve().parents[1] / "scripts" / "bench_h100_budgets.py"
)
bench = importlib.util.module_from_spec(_spec)  # type: ignore[arg-type]
_spec.loader.exec_module(bench)  # type: ignore[union-attr]


def timed_members(monkeypatch, granted: list[tuple[str, float]]) -> None:
    """Two searches of share 0.4 that record the seconds they are given and find nothing; a heuristic that fits
    nothing."""

    def no_fit(problem, options, warm):
        raise BudgetError("does not fit", stage="solve")

    def member(name: str) -> registry.SolverEntry:
        def fn(problem, options, warm):
            granted.append((name, options.time_limit_s))
            return Outcome(SolveResult(name, "no_incumbent", message="found nothing"))

        return registry.SolverEntry(name, fn, kind="search", share=0.4)

    monkeypatch.setitem(registry.SOLVERS, "no-fit", registry.heuristic("no-fit", no_fit))
    for name in ("first", "second"):
        monkeypatch.setitem(registry.SOLVERS, name, member(name))


@pytest.mark.parametrize("heuristic", ["no-fit", "checkpoint"])
def test_the_first_search_gets_most_of_the_time_only_while_there_is_no_plan(monkeypatch, heuristic: str) -> None:
    """On a clock that stands still, 10 s are left for the searches: without a plan the first gets
    NO_PLAN_SHARE of them (7.5 s), after a heuristic's plan its own share (4 s); the last gets all that is left."""
    granted: list[tuple[str, float]] = []
    timed_members(monkeypatch, granted)
    with using_clock(FakeClock(0.0)):
        r = run(problem(), Configuration("test", (heuristic, "first", "second")), SolverOptions(time_limit_s=10.0))
    first = runner.NO_PLAN_SHARE if heuristic == "no-fit" else 0.4
    assert granted == [("first", pytest.approx(10.0 * first)), ("second", pytest.approx(10.0))]
    assert (r.plan is None) == (heuristic == "no-fit")


def test_a_warm_start_counts_as_a_plan(monkeypatch) -> None:
    """The caller's plan that meets the budgets is a plan: the first search keeps its own share."""
    granted: list[tuple[str, float]] = []
    timed_members(monkeypatch, granted)
    p = problem()
    with using_clock(FakeClock(0.0)):
        given = run(p, Configuration("heuristics", ("checkpoint",)), SolverOptions(time_limit_s=10.0)).plan
        run(p, Configuration("test", ("no-fit", "first", "second")), SolverOptions(time_limit_s=10.0), given)
    assert granted[0] == ("first", pytest.approx(4.0))


@pytest.mark.parametrize("stem", ["gpt2-full_n_layer6", "gpt2-full_n_layer6-chunk8"])
def test_the_h100_files_of_2026_11_27_are_a_graph_and_its_profile_with_the_host_links(stem: str) -> None:
    def read(what: str) -> dict:
        with gzip.open(GPU / f"{stem}.h100-20261127.{what}.json.gz", "rt") as f:
            return json.load(f)

    graph, profile = Graph.from_dict(read("graph")), Profile.from_dict(read("profile"))
    assert profile.graph == graph.fingerprint
    assert all(profile.op_cost(op.id, "cuda:0") is not None for op in graph.ops)
    assert {"cuda:0->cpu", "cpu->cuda:0"} <= set(profile.copy)


def test_the_bench_budgets_are_the_gpu_runs_own() -> None:
    """The budgets the H100 run of 2026-11-27 planned at (its gpu_memory.json): at checkpoint's peak, the resident
    1,980,894,212 B plus checkpoint's measured 6,794,977,792 B; 45% of the eager peak, 7,448,803,894 B."""
    graph, _ = bench.load("gpt2-full_n_layer6")
    assert bench.gpu_budget(graph, "ckpt") == 1_980_894_212 + 6_794_977_792 == 8_775_872_004
    assert bench.gpu_budget(graph, "45") == 7_448_803_894
