"""Reruns dropped where their outputs can be kept (`keep-recomputes`): on a small GPT typed for a GPU (its dropout one
fused op with two outputs, the loss in 8 row blocks, `loss.backward()`), on cpu:0 with cpu:1 as a store over a slow
link, at 35% of the eager peak, from park's plan. The result against the independent counts of peak and time, its
structure (only reruns removed, each kept output resident from where it was made to its read), the runner's last
pass on a search's plan, and a run of it against eager PyTorch."""

from __future__ import annotations

import functools
from dataclasses import replace

import pytest
from oracle import assert_prediction_matches, residencies
from test_park_quarter import LINK, model_and_inputs
from test_park_store import assert_plan_trains_as_eager, eager_loss_backward

from xsched.capture.chunk_loss import chunk_cross_entropy
from xsched.capture.torch import bind_inputs, capture
from xsched.contracts.graph import Graph
from xsched.contracts.plan import Compute, Free, Plan
from xsched.contracts.profile import Profile
from xsched.profiling.model import cost_profile
from xsched.solve import SolverOptions, eager_peak, runner, solve
from xsched.solve.heuristics.keep_recomputes import without_rerun
from xsched.solve.heuristics.park_recomputes import reruns
from xsched.solve.problem import Problem
from xsched.solve.registry import SOLVERS, SolverEntry, from_plan

pytestmark = pytest.mark.usefixtures("one_thread")

DEVICES = ("cpu:0", "cpu:1")
BUDGET_PCT = 35  # park's plan reruns 60 ops here, 34 of them can go


@functools.cache
def setup() -> tuple[Graph, Profile, dict[str, int]]:
    model, inputs = model_and_inputs()
    g = chunk_cross_entropy(capture(model, inputs, grad_outputs="auto", device_type="cuda"), 8)
    profile = replace(cost_profile(g, ["cpu:0"], stores=["cpu:1"]), copy={"cpu:0->cpu:1": LINK, "cpu:1->cpu:0": LINK})
    return g, profile, {"cpu:0": eager_peak(g) * BUDGET_PCT // 100, "cpu:1": 1 << 40}


@functools.cache
def plans() -> tuple[Plan, Plan]:
    """(park's plan, keep-recomputes' plan from it)."""
    g, profile, budgets = setup()
    base = solve(g, profile, budgets, list(DEVICES), "park", SolverOptions(time_limit_s=30))
    kept = solve(g, profile, budgets, list(DEVICES), "keep-recomputes", SolverOptions(time_limit_s=30), warm_start=base)
    return base, kept


def recomputes(g: Graph, plan: Plan, target: str | None = None) -> int:
    runs = [s.op for s in plan.steps if isinstance(s, Compute)]
    return sum(1 for o in runs if target is None or g.op[o].target == target) - sum(
        1 for o in g.ops if target is None or o.target == target
    )


def test_dropping_reruns_is_faster_and_fits() -> None:
    g, profile, budgets = setup()
    base, kept = plans()
    assert kept.solver.method == "keep-recomputes" and "park's plan" in kept.solver.message
    assert_prediction_matches(g, kept, profile, budgets)  # peaks (within the budgets) and time, counted apart
    assert recomputes(g, kept) < recomputes(g, base)
    assert kept.predicted.makespan_s < base.predicted.makespan_s
    # the dropout, two outputs, is no longer run again for its mask after a rerun for its output
    dropout = "aten.native_dropout.default"
    assert recomputes(g, kept, dropout) < recomputes(g, base, dropout)
    # only reruns removed: the same computes otherwise, in the same order, and the same copies
    runs = [s for s in kept.steps if not isinstance(s, Free)]
    it = iter(s for s in base.steps if not isinstance(s, Free))
    assert all(any(t == s for t in it) for s in runs)  # a subsequence of park's steps
    first = lambda p: list(dict.fromkeys(s.op for s in p.steps if isinstance(s, Compute)))  # noqa: E731
    assert first(kept) == first(base)


def test_without_a_rerun_its_outputs_stay_from_where_they_were_made() -> None:
    """One rerun removed by hand: each output read after it is resident at every step from its last making before
    to that read, and nothing else changes but frees."""
    g, _, _ = setup()
    base, _ = plans()
    steps = list(base.steps)
    j = next(k for k in reruns(g, steps) if without_rerun(g, steps, k) is not None)
    edited = without_rerun(g, steps, j)
    assert (
        edited is not None
        and len([s for s in edited if isinstance(s, Compute)]) == len([s for s in steps if isinstance(s, Compute)]) - 1
    )
    assert [s for s in edited if not isinstance(s, Free)] == [
        s for k, s in enumerate(steps) if k != j and not isinstance(s, Free)
    ]
    op = steps[j]
    held = list(residencies(g, replace(base, steps=tuple(edited))))
    before = sum(1 for s in steps[:j] if not isinstance(s, Free))  # the edited plan's index of the step after j
    for v in g.op[op.op].outputs:
        reader = next(
            (k for k, s in enumerate(edited) if k >= before and isinstance(s, Compute) and v in g.op[s.op].inputs), None
        )
        if reader is not None and not any(
            isinstance(s, Compute) and v in g.op[s.op].outputs for s in edited[before:reader]
        ):
            assert all((v, op.device) in held[k] for k in range(before, reader))


def test_the_runner_gives_a_searchs_plan_a_last_pass(monkeypatch) -> None:
    """A timed member's plan (a search stands in for one, returning park's plan) gets the pass at the end, in the
    share of the limit kept for it, and the run's plan is the faster one."""
    g, profile, budgets = setup()
    base, kept = plans()
    search = SolverEntry("park-as-search", from_plan(lambda p, o, w: base, proofs=False), kind="search")
    monkeypatch.setitem(SOLVERS, search.name, search)
    problem = Problem(g, profile, budgets, DEVICES, dict(base.homes))
    config = runner.Configuration("auto", ("keep-recomputes", search.name))
    out = runner.run(problem, config, SolverOptions(time_limit_s=30))
    members = {m.method: m for m in out.plan.solver.stats.members}
    assert members["keep-recomputes"].status == "no_incumbent"  # among the heuristics: nothing to refine yet
    assert "keep-recomputes (last)" in members
    assert out.plan.solver.stats.found_by == "keep-recomputes"
    assert out.plan.predicted.makespan_s == pytest.approx(kept.predicted.makespan_s)


@pytest.mark.parametrize("overlap", [None, True])
def test_the_kept_plan_trains_as_eager(overlap: bool | None) -> None:
    """Step by step (the reference runner) and on the executor's lanes: eager's logits, loss and gradients from
    `loss.backward()`, the dropout masks included (a kept mask is the one drawn in the forward)."""
    model, inputs = model_and_inputs()
    g, _, _ = setup()
    _, kept = plans()
    outputs, grads = eager_loss_backward(model, inputs)
    assert_plan_trains_as_eager(g, kept, bind_inputs(g, model, inputs), outputs, grads, overlap)
