"""Compiled plans through wrap's own profile -> plan path: priced as fused, their predicted peak the compiled regions'
real allocations (against the CPU allocator's events), and the re-plan or fallback when a compiled run overruns."""

from __future__ import annotations

import copy
import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from test_compile import chain  # fusible chains between matmuls, no dropout or batch norm
from torch import nn
from torch.testing import assert_close

from xsched.contracts.plan import Compute
from xsched.execute import compiled_replans
from xsched.execute import segments as segments_module
from xsched.execute.compiled_memory import MAX_SPLITS, PLANNED_WITHIN_KEY
from xsched.execute.wrap import MAX_REPLANS, wrap
from xsched.pipeline import PER_OP_KEY, plan_profile
from xsched.profiling.fused import fusible
from xsched.simulate import simulate

pytestmark = pytest.mark.usefixtures("one_thread")

# torch.compile's own tolerance against eager on float32 (fused kernels reassociate sums): torch's inductor tests
TOL = {"rtol": 1e-4, "atol": 1e-5}

_spec = importlib.util.spec_from_file_location(
    "bench_executor", Path(__file__).resolve().parents[1] / "scripts" / "bench_executor.py"
)
bench = importlib.util.module_from_spec(_spec)  # type: ignore[arg-type]
sys.modules["bench_executor"] = bench
_spec.loader.exec_module(bench)  # type: ignore[union-attr]


def data(k: int) -> torch.Tensor:
    return torch.randn(64, 16, generator=torch.Generator().manual_seed(k))


def step(m: nn.Module, k: int) -> torch.Tensor:
    loss = bench.loss_of(m(data(k)))
    loss.backward()
    return loss.detach()


def resident(w: nn.Module) -> int:
    g = w.graph
    return sum(g.value[v].nbytes for v in g.inputs if g.value[v].kind != "tangent")


@pytest.fixture(scope="module")
def inductor_run():
    """One compiled plan by wrap at 85% of the eager peak (it recomputes), inductor on its regions; its first step
    and the allocator's count of the second; eager PyTorch's two steps beside it."""
    eager = chain()
    w = wrap(copy.deepcopy(eager), (data(0),), {"cpu": "85%"}, profile="model", inplace=False, compile=True)
    per_op = dict(w.plan.predicted.peak_bytes)
    losses = [step(w, 0)]  # compiles and measures the regions
    x = data(1)  # made before the count: the step's allocations only
    mem = bench.step_memory(lambda: bench.loss_of(w(x)), [*w.parameters()])
    w.zero_grad()
    losses.append(step(w, 1))
    want = [step(eager, 0)]
    eager.zero_grad()
    want.append(step(eager, 1))
    return {"w": w, "eager": eager, "per_op": per_op, "losses": losses, "want": want, "mem": mem}


def test_wrap_plans_a_compiled_model_with_fused_costs(inductor_run) -> None:
    w = inductor_run["w"]
    fused = plan_profile(w.graph, ["cpu"], "model", fused=True)
    plain = plan_profile(w.graph, ["cpu"], "model")
    for op in w.graph.ops:
        want = 0.0 if fusible(op) else plain.compute["cpu"][op.id].time_s
        assert fused.compute["cpu"][op.id].time_s == want, op.target
    assert w.plan.predicted.time_s == pytest.approx(simulate(w.graph, w.plan, fused).time_s)
    assert sum(isinstance(s, Compute) for s in w.plan.steps) > len(w.graph.ops)  # it recomputes


def test_a_compiled_plan_predicts_the_peak_the_allocator_counts(inductor_run) -> None:
    """After its first step the plan's predicted peak is its compiled regions' (measured then): the allocator's
    events of the next step agree, to the loss and its gradient; fused intermediates never materialise, so it is
    below the per-op count, which the plan keeps beside it."""
    w, mem = inductor_run["w"], inductor_run["mem"]
    segments = w._first.executor.segments
    assert segments.peaks and not segments.failed
    predicted = w.plan.predicted.peak_bytes["cpu"]
    assert w.plan.extra[PER_OP_KEY] == inductor_run["per_op"]
    assert 0 <= mem.peak - (predicted - resident(w)) <= 2 * bench.LOSS_BYTES
    assert predicted < inductor_run["per_op"]["cpu"] <= w.plan.budgets["cpu"]
    assert "measured on the first run" in w.report()


def test_a_compiled_plan_trains_like_eager(inductor_run) -> None:
    for a, b in zip(inductor_run["losses"], inductor_run["want"]):
        assert_close(a, b, **TOL)
    for (n, p), q in zip(inductor_run["eager"].named_parameters(), inductor_run["w"].parameters()):
        assert_close(q.grad, p.grad, **TOL, msg=lambda s, n=n: f"grad of {n}: {s}")


SCRATCH = 6000  # bytes a stand-in compiler's region allocates beside its values, as inductor's buffers can


def scratching(gm: torch.fx.GraphModule, inputs: list) -> object:
    """A region "compiled" as its fx graph run as it is (no inductor: fast, and the same aten calls as the
    uncompiled steps, so the numbers are eager's) that holds SCRATCH bytes while it runs."""

    def run(args: list) -> object:
        scratch = torch.empty(SCRATCH // 4)
        out = torch.fx.Interpreter(gm).boxed_run(args)  # it empties args: each value freed after its last use
        del scratch
        return out

    return run


def _train(w: nn.Module, eager: nn.Module, steps: int) -> None:
    for k in range(steps):
        for m in (w, eager):
            m.zero_grad()
        assert_close(step(w, k), step(eager, k), rtol=0, atol=0)
        for (n, p), q in zip(eager.named_parameters(), w.parameters()):
            assert_close(q.grad, p.grad, rtol=0, atol=0, msg=lambda s, n=n: f"grad of {n}: {s}")


def replanning_wrap(eager: nn.Module) -> nn.Module:
    """`eager` wrapped compiled at 85% by `checkpoint`: a deterministic planner that answers at once, for the tests
    of the re-plan path (not of the solver)."""
    return wrap(
        copy.deepcopy(eager),
        (data(0),),
        {"cpu": "85%"},
        profile="model",
        inplace=False,
        compile=True,
        method="checkpoint",
    )


def test_a_region_whose_compiled_code_would_overrun_is_split_before_it_runs(capsys) -> None:
    """The compiled eager plan at 100% of the eager peak, with inductor: a region's generated code would go over the
    budget (fused kernels hold their inputs while they write), so it is split before its first call, and the
    first step, each region measured by the allocator as it runs, is within the budget: nothing measured over
    it, nothing split or solved after it. The allocator's count of the next step is the predicted peak (the
    regions as measured); every step trains like eager PyTorch."""
    from test_compile import model

    eager = model()
    w = wrap(copy.deepcopy(eager), (data(0),), {"cpu": "100%"}, method="eager", profile="model", compile=True)
    limit = w.plan.budgets["cpu"]
    for k in range(2):
        eager.zero_grad()
        w.zero_grad()
        torch.manual_seed(k)  # dropout's draws: the same stream for both
        got = step(w, k)
        torch.manual_seed(k)
        assert_close(got, step(eager, k), **TOL)
        for (n, p), q in zip(eager.named_parameters(), w.parameters()):
            assert_close(q.grad, p.grad, **TOL, msg=lambda s, n=n: f"grad of {n}: {s}")
    err = capsys.readouterr().err
    assert "its compiled code peaks at" in err and "split before step" in err
    assert "the compiled plan peaked" not in err and "runs uncompiled" not in err
    assert w._first.first_run is None and w._first.executor.segments.split_rounds == 0
    # One cut, where one suffices: the backward region peaks in the kernel fusing the second block's tanh, batch
    # norm and GELU backward (it holds what they read while it writes); of its 22 single cuts (each tried once,
    # both parts compiled and their code read), only the one before the batch norm backward fits both parts.
    ((cut,),) = [w._first.executor.segments.cuts]
    assert err.count("split before step") == 1
    bn = [
        i
        for i, s in enumerate(w.plan.steps)
        if isinstance(s, Compute) and "batch_norm_backward" in w.graph.op[s.op].target
    ]
    assert cut == bn[0]
    predicted = w.plan.predicted.peak_bytes["cpu"]
    x = data(2)
    mem = bench.step_memory(lambda: bench.loss_of(w(x)), [*w.parameters()])
    assert 0 <= mem.peak - (predicted - resident(w)) <= 2 * bench.LOSS_BYTES
    assert predicted <= limit


def test_an_overrunning_compiled_plan_splits_its_regions_until_it_fits(monkeypatch, capsys) -> None:
    """Regions that allocate more than the plan counts: the first step overruns, and each next call runs the
    regions over the budget split in two (a part of one compute uncompiled, as counted), until the step fits: the
    same plan, not solved again. Settled, its predicted peak is the allocator's count of a step (the loss and its
    gradient beside), within the budget. Every step equals eager PyTorch."""
    monkeypatch.setattr(segments_module, "_inductor", scratching)
    eager = chain()
    w = replanning_wrap(eager)
    limit, first = w.plan.budgets["cpu"], w.plan
    for _ in range(MAX_SPLITS + 1):
        _train(w, eager, 1)
        if w._first.first_run is None:
            break  # settled
    err = capsys.readouterr().err
    assert w._first.first_run is None and w._first.replan is None
    assert "the compiled plan peaked at cpu" in err and "its regions over the budget split" in err
    assert "split before step" in err and "planning again" not in err and "runs uncompiled" not in err
    assert w.plan.steps == first.steps and PLANNED_WITHIN_KEY not in w.plan.extra
    segments = w._first.executor.segments
    assert segments.cuts and segments.peaks and not segments.failed
    predicted = w.plan.predicted.peak_bytes["cpu"]
    x = data(2)
    mem = bench.step_memory(lambda: bench.loss_of(w(x)), [*w.parameters()])
    assert 0 <= mem.peak - (predicted - resident(w)) <= 2 * bench.LOSS_BYTES
    assert predicted <= limit
    _train(w, eager, 1)


def test_an_overrunning_compiled_run_is_planned_again_within_the_budget(monkeypatch, capsys) -> None:
    """Regions that allocate more than the plan counts, with splitting off: the first step overruns, the next call
    runs a plan solved within the budget less the excess, and from then on the step stays within the budget by the
    allocator's count (the re-plan's regions that still overrun run uncompiled, each named). Every step equals
    eager PyTorch."""
    monkeypatch.setattr(segments_module, "_inductor", scratching)
    monkeypatch.setattr(compiled_replans, "MAX_SPLITS", 0)
    eager = chain()
    w = replanning_wrap(eager)
    limit = w.plan.budgets["cpu"]
    _train(w, eager, 1)
    err = capsys.readouterr().err
    assert "the compiled plan peaked at cpu" in err and "planning again within less" in err
    first = w.plan
    for _ in range(MAX_REPLANS):  # each re-plan runs: solved within less, recorded against the budget
        _train(w, eager, 1)
        if w._first.first_run is None and w._first.replan is None:
            break  # settled
    assert w._first.first_run is None and w._first.replan is None
    assert w.plan is not first and w.plan.budgets["cpu"] == limit
    assert w.plan.extra[PLANNED_WITHIN_KEY]["cpu"] < limit
    assert w.plan.predicted.peak_bytes["cpu"] <= limit
    notices = [line for line in capsys.readouterr().err.splitlines() if "runs uncompiled" in line]
    assert all("over the budget" in line and line.startswith("xsched: region steps ") for line in notices)
    x = data(2)
    mem = bench.step_memory(lambda: bench.loss_of(w(x)), [*w.parameters()])
    assert mem.peak <= limit - resident(w) + 2 * bench.LOSS_BYTES
    _train(w, eager, 1)


def plain_fx(gm: torch.fx.GraphModule, inputs: list) -> object:
    """A region "compiled" as its fx graph run as it is: eager's numbers and allocations, at once."""
    return lambda args: torch.fx.Interpreter(gm).boxed_run(args)


@pytest.mark.parametrize("raised_fits", [False, True])
def test_a_replan_far_under_the_budget_is_raised_and_an_overrunning_raise_goes_back(
    monkeypatch, capsys, raised_fits
) -> None:
    """The compiled peaks each first run measures, scripted: the first plan over the limit, its re-plan 30% under
    it (memory recomputes could use), so it is solved once more within more; that plan, when over, gives way to the
    re-plan that fit, and when within, stays. Every step equals eager PyTorch."""

    monkeypatch.setattr(segments_module, "_inductor", plain_fx)
    eager = chain()
    w = replanning_wrap(eager)
    limit = w.plan.budgets["cpu"]
    script = iter([limit + limit // 10, limit * 7 // 10, limit + (-1 if raised_fits else 1)])
    monkeypatch.setattr(compiled_replans, "compiled_peaks", lambda *a: {"cpu": next(script)})
    _train(w, eager, 1)  # the first plan measured over: solved again within less
    first = w._first
    _train(w, eager, 1)  # the re-plan, measured 30% under: solved again within more
    lowered = w._first
    assert lowered is not first and lowered.replan is not None
    # within half the room more: the per-op count may pass the limit, which the compiled peak is measured against
    within = lowered.plan.extra[PLANNED_WITHIN_KEY]["cpu"]
    assert lowered.replan["cpu"] == within + (limit - limit * 7 // 10) // 2
    assert "planning again within more" in capsys.readouterr().err
    _train(w, eager, 1)  # the raised plan, measured at the limit +-1
    raised = w._first
    assert raised is not lowered and raised.plan.extra[PLANNED_WITHIN_KEY]["cpu"] == lowered.replan["cpu"]
    _train(w, eager, 1)
    err = capsys.readouterr().err
    if raised_fits:
        assert w._first is raised and "back to the plan before it" not in err
    else:
        assert w._first is lowered and "back to the plan before it" in err
    assert w._first.replan is None and w._first.back_to is None and w._first.first_run is None
    assert w.plan.budgets["cpu"] == limit
    _train(w, eager, 1)


def test_a_given_plan_that_overruns_runs_the_overrunning_regions_uncompiled(monkeypatch, capsys) -> None:
    """A plan given to wrap is not solved again: each region over the budget runs uncompiled, with a one-line
    notice naming it, and the step is within the budget by the allocator's count."""
    monkeypatch.setattr(segments_module, "_inductor", scratching)
    eager = chain()
    planned = wrap(copy.deepcopy(eager), (data(0),), {"cpu": "85%"}, profile="model", compile=True)
    w = wrap(copy.deepcopy(eager), (data(0),), {"cpu": "85%"}, plan=planned.plan, inplace=False, compile=True)
    limit = w.plan.budgets["cpu"]
    _train(w, eager, 1)
    notices = [line for line in capsys.readouterr().err.splitlines() if line.startswith("xsched:")]
    assert notices and all(
        line.startswith("xsched: region steps ") and "runs uncompiled (compiled, it peaks at" in line
        for line in notices
    )
    assert w._first.executor.segments.failed and w.plan.predicted.peak_bytes["cpu"] <= limit
    x = data(1)
    mem = bench.step_memory(lambda: bench.loss_of(w(x)), [*w.parameters()])
    assert mem.peak <= limit - resident(w) + 2 * bench.LOSS_BYTES
    _train(w, eager, 1)


def test_xsched_plan_compile_prices_the_ops_as_fused(tmp_path) -> None:
    """`xsched plan --compile`: the plan's predicted time is the simulator's on the fused profile, below the same
    plan's on the profile as given (the chain's layer norm, GELU and tanh cost nothing fused)."""
    import json

    from xsched.capture.torch import capture
    from xsched.cli import main
    from xsched.contracts.plan import Plan
    from xsched.profiling.fused import fused_profile
    from xsched.profiling.model import cost_profile

    graph = capture(chain(), (data(0),))
    profile = cost_profile(graph, ["cpu"])
    g, p, out = tmp_path / "g.json", tmp_path / "p.json", tmp_path / "plan.json"
    g.write_text(json.dumps(graph.to_dict()))
    p.write_text(json.dumps(profile.to_dict()))
    assert main(["plan", str(g), str(p), "--budget", "cpu=85%", "--compile", "--quiet", "-o", str(out)]) == 0
    plan = Plan.load(out)
    fused = simulate(graph, plan, fused_profile(graph, profile, "cpu")).time_s
    assert plan.predicted.time_s == pytest.approx(fused) and fused < simulate(graph, plan, profile).time_s


def test_the_training_plan_cache_keys_and_prices_a_compiled_run_as_fused(tmp_path) -> None:
    """`xsched train --compile` plans through cached_plan(fused=True): its own cache entry, priced as fused."""
    from xsched.capture.torch import capture
    from xsched.profiling.fused import fused_profile
    from xsched.profiling.model import cost_profile
    from xsched.train.plans import cached_plan

    graph = capture(chain(), (data(0),))
    how = dict(profile="model", time_limit=5, cache_dir=tmp_path, notice=lambda s: None)
    fused = cached_plan(graph, {"cpu": "85%"}, ["cpu"], fused=True, **how)
    plain = cached_plan(graph, {"cpu": "85%"}, ["cpu"], **how)
    assert fused.path != plain.path and not fused.reused
    want = simulate(graph, fused.plan, fused_profile(graph, cost_profile(graph, ["cpu"]), "cpu")).time_s
    assert fused.plan.predicted.time_s == pytest.approx(want)
    assert cached_plan(graph, {"cpu": "85%"}, ["cpu"], fused=True, **how).reused
