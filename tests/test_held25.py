"""Reruns traded for parks (`park-recomputes`, issue 31's 25% with the logits held): on a small GPT of the H100 rows'
shape (the loss in 8 row blocks, only the loss differentiated, the logits held by the caller through backward, as
`wrap` plans `loss.backward()`), on cpu:0 with cpu:1 as a store over a slow link, at half the eager peak. The
checkpoint heuristic's plan recomputes; the trade keeps its order, parks some of what it recomputed, and is
faster. The plan's peaks and time against the independent counts, the held logits kept to the end, and a run of it
against eager PyTorch (logits, loss, every gradient)."""

from __future__ import annotations

import functools
from dataclasses import replace

import pytest
from oracle import assert_prediction_matches, resident_at_end
from test_park_quarter import LINK, model_and_inputs  # the same small GPT and slow store link
from test_park_store import assert_plan_trains_as_eager, eager_loss_backward

from xsched.capture.chunk_loss import chunk_cross_entropy
from xsched.capture.torch import bind_inputs, capture
from xsched.contracts.graph import Graph
from xsched.contracts.plan import Compute, Copy, Free, Plan
from xsched.contracts.profile import Profile
from xsched.profiling.model import cost_profile
from xsched.solve import SolverOptions, eager_peak, solve
from xsched.solve.autograd_boundary import forward_outputs
from xsched.solve.heuristics.park_recomputes import apply_trades, reruns, trades
from xsched.solve.heuristics.timeline import op_seconds

pytestmark = pytest.mark.usefixtures("one_thread")

DEVICES = ("cpu:0", "cpu:1")
# of the eager peak: checkpoint's plan recomputes 68 ops here, park's is slower still (45% and below: no
# checkpoint plan, so nothing to trade from)
BUDGET_PCT = 50


@functools.cache
def setup() -> tuple[Graph, Profile, dict[str, int]]:
    """The graph as `wrap` plans `loss.backward()` with the loss in 8 row blocks: the loss alone differentiated,
    the logits held; modelled costs, the slow store; the budgets."""
    model, inputs = model_and_inputs()
    g = capture(model, inputs, grad_outputs="auto")
    g = replace(g, held_outputs=tuple(v for v in forward_outputs(g) if g.value[v].shape != ()))
    g = chunk_cross_entropy(g, 8)
    profile = replace(cost_profile(g, ["cpu:0"], stores=["cpu:1"]), copy={"cpu:0->cpu:1": LINK, "cpu:1->cpu:0": LINK})
    return g, profile, {"cpu:0": eager_peak(g) * BUDGET_PCT // 100, "cpu:1": 1 << 40}


@functools.cache
def plans() -> tuple[Plan, Plan]:
    """(checkpoint's plan, park-recomputes' plan: checkpoint's with reruns traded, the method alone started
    from it)."""
    g, profile, budgets = setup()
    opts = SolverOptions(time_limit_s=60)
    base = solve(g, profile, budgets, list(DEVICES), "checkpoint", opts)
    return base, solve(g, profile, budgets, list(DEVICES), "park-recomputes", opts, warm_start=base)


def recomputes(g: Graph, plan: Plan) -> int:
    return sum(isinstance(s, Compute) for s in plan.steps) - len(g.ops)


def test_the_graph_holds_the_logits_and_differentiates_the_loss_alone() -> None:
    g, _, _ = setup()
    (logits,) = g.held_outputs
    assert g.value[logits].nbytes == 4 * 128 * 2048 * 4
    assert not any(g.value[v].kind == "tangent" and g.value[v].nbytes > 4 for v in g.inputs)


def test_trading_reruns_for_parks_is_faster_and_fits() -> None:
    g, profile, budgets = setup()
    base, traded = plans()
    assert traded.solver.method == "park-recomputes"
    assert_prediction_matches(g, traded, profile, budgets)
    assert recomputes(g, traded) < recomputes(g, base)
    assert sum(isinstance(s, Copy) and s.src == "cpu:0" for s in traded.steps) > 0
    assert not any(isinstance(s, Copy) for s in base.steps)
    assert traded.predicted.makespan_s < base.predicted.makespan_s
    # the same first computes in the same order: only reruns removed
    first = [s.op for k, s in enumerate(base.steps) if isinstance(s, Compute)]
    kept = [s.op for s in traded.steps if isinstance(s, Compute)]
    assert [o for k, o in enumerate(first) if o not in first[:k]] == [
        o for k, o in enumerate(kept) if o not in kept[:k]
    ]


def test_the_held_logits_stay_on_the_device_to_the_end() -> None:
    g, _, _ = setup()
    _, traded = plans()
    (logits,) = g.held_outputs
    assert traded.boundary is not None
    assert not any(isinstance(s, Free) and s.value == logits for s in traded.steps[traded.boundary :])
    assert (logits, "cpu:0") in resident_at_end(g, traded)


def test_a_trade_parks_the_rerun_outputs_and_drops_the_reruns_that_fed_it() -> None:
    """One trade on checkpoint's plan: the rerun is gone, each output it served is copied out after it was made,
    freed on the device after that copy and copied back before the read, and no rerun is left unread."""
    g, profile, _ = setup()
    base, _ = plans()
    body = [s for s in base.steps if not isinstance(s, Free)]
    cands = trades(g, body, "cpu:0", "cpu:1", op_seconds(g, "cpu:0", profile))
    assert cands and all(c.saved > 0 and c.moved > 0 for c in cands)
    t = next(c for c in cands if any(out is not None for _, out, _, _ in c.copies))
    steps = apply_trades(g, body, [t], "cpu:0", "cpu:1", profile, op_seconds(g, "cpu:0", profile), base.homes)
    assert recomputes(g, replace(base, steps=tuple(steps))) < recomputes(g, base)
    for v, out, _, _ in t.copies:
        if out is None:
            continue
        q = next(k for k, s in enumerate(steps) if s == Copy(v, "cpu:0", "cpu:1"))
        f = next(k for k, s in enumerate(steps) if k > q and s == Free(v, "cpu:0"))
        back = next(k for k, s in enumerate(steps) if k > f and s == Copy(v, "cpu:1", "cpu:0"))
        read = next(k for k, s in enumerate(steps) if k > back and isinstance(s, Compute) and v in g.op[s.op].inputs)
        assert not any(isinstance(s, Compute) and v in g.op[s.op].outputs for s in steps[q:read])
    for j in reruns(g, steps):  # every rerun left is read before its outputs are made again
        s = steps[j]
        assert any(isinstance(r, Compute) and set(g.op[r.op].inputs) & set(g.op[s.op].outputs) for r in steps[j + 1 :])


def test_alone_it_starts_from_checkpoints_plan() -> None:
    g, profile, budgets = setup()
    plan = solve(g, profile, budgets, list(DEVICES), "park-recomputes", SolverOptions(time_limit_s=60))
    assert plan.steps == plans()[1].steps


def test_auto_trades_the_best_plan_so_far() -> None:
    """Among the heuristics (as in `auto`, which runs them first) the trade runs on the best plan so far
    (checkpoint's here) and improves on it."""
    g, profile, budgets = setup()
    plan = solve(g, profile, budgets, list(DEVICES), "heuristics", SolverOptions(time_limit_s=60))
    members = {m.method: m for m in plan.solver.stats.members}
    assert members["park-recomputes"].objective is not None
    assert members["park-recomputes"].objective < members["checkpoint"].objective
    assert plan.predicted.makespan_s <= plans()[1].predicted.makespan_s * (1 + 1e-9)


@pytest.mark.parametrize("overlap", [None, True])
def test_the_traded_plan_trains_as_eager(overlap: bool | None) -> None:
    """Step by step (the reference runner) and on the executor's lanes: eager's logits, loss and gradients from
    `loss.backward()`."""
    model, inputs = model_and_inputs()
    g, _, _ = setup()
    _, traded = plans()
    outputs, grads = eager_loss_backward(model, inputs)
    assert_plan_trains_as_eager(g, traded, bind_inputs(g, model, inputs), outputs, grads, overlap)
