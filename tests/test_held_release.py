"""Outputs the caller holds, released during backward and refilled in the caller's own storage (`contracts.holds`,
`execute.held`): which ops may refill in place, the hold rule's repair, and wrapped steps against an
allocator-level count and eager PyTorch, at budgets where keeping the output resident through backward fits no
plan."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from test_wrap_held import blocks, counting, predicted_above_homes, step_peaks, wrap_module
from torch.testing import assert_close

from xsched.contracts import holds
from xsched.contracts.plan import Compute, Copy
from xsched.errors import BudgetError, XschedError
from xsched.execute.executor import Executor
from xsched.execute.live_bytes import LiveBytes
from xsched.solve import autograd_boundary
from xsched.solve.autograd_boundary import hold_to_end

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize(
    "target,into",
    [
        ("aten.mm.default", "aten.mm.out"),
        ("aten.addmm.default", "aten.addmm.out"),
        ("aten.tanh.default", "aten.tanh.out"),
        ("aten.add.Tensor", "aten.add.out"),
        ("aten.view.default", None),  # a view: the caller's storage is another value's
        ("aten.native_dropout.default", None),  # random, and two outputs
        ("aten.native_layer_norm.default", None),  # three outputs
        ("aten.mm.out", None),
    ],
)
def test_which_ops_refill_in_place(target: str, into: str | None) -> None:
    assert holds.into_target(target) == into


def pinned_everywhere(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every held output pinned, as before outputs could be released."""
    monkeypatch.setattr(holds, "releasable", lambda graph: frozenset())
    monkeypatch.setattr(autograd_boundary, "releasable", lambda graph: frozenset())


@pytest.mark.parametrize(
    "budgets,method,stores,refill",
    [
        ({"cpu:0": "82%"}, "checkpoint", (), Compute),  # recomputed at the end through tanh's out= form
        ({"cpu:0": "80%"}, "park", ("cpu:1",), Copy),  # parked on the store, copied back at the end
    ],
    ids=["recomputed", "parked"],
)
def test_a_released_output_is_counted_and_refilled_as_eager_made_it(
    monkeypatch: pytest.MonkeyPatch, budgets: dict, method: str, stores: tuple, refill: type
) -> None:
    """With the output pinned no plan of the method fits; released after backward read it, the counted peak is the
    predicted one (3%, as tests/test_wrap_held.py), the caller's tensor holds eager's output again when backward
    returns, and the gradients are eager's."""
    x = torch.randn(512, 64)
    with monkeypatch.context() as m:
        pinned_everywhere(m)
        with pytest.raises(BudgetError):
            wrap_module.wrap(blocks(), (x,), budgets, method=method, profile="model", time_limit=10, stores=stores)
    eager = blocks()
    model = copy.deepcopy(eager)
    count = LiveBytes()
    counting(monkeypatch, count)
    w = wrap_module.wrap(model, (x,), budgets, method=method, profile="model", time_limit=10, stores=stores)
    kinds = {(k, type(w.plan.steps[i])) for i, (k, _) in holds.held_steps(w.graph, w.plan).items()}
    assert ("refill", refill) in kinds and any(k == "release" for k, _ in kinds), kinds
    got, want = step_peaks(w, x, count), predicted_above_homes(w)
    for d in w.plan.devices:
        assert abs(got[d] - want[d]) <= 0.03 * max(want[d], got[d]), (d, want[d], got[d])
    monkeypatch.undo()
    for p in model.parameters():
        p.grad = None
    out = w(x)
    out.square().mean().backward()
    ref = eager(x)
    ref.square().mean().backward()
    assert_close(out, ref.detach(), rtol=1e-5, atol=1e-6)
    for (n, p), q in zip(model.named_parameters(), eager.parameters()):
        assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=lambda m, n=n: f"grad {n}: {m}")


@pytest.mark.parametrize(
    "method,stores,fits,tight", [("checkpoint", (), "92%", "82%"), ("park", ("cpu:1",), "88%", "80%")]
)
def test_where_keeping_the_output_fits_the_plan_keeps_it(method: str, stores: tuple, fits: str, tight: str) -> None:
    """A release costs the refill at the end, which the heuristics do not weigh (park, free to release, releases at
    88% too): where a plan keeping the output resident fits, that is the plan (solve.registry.run_member tries it
    first); at the tight budget only a release fits."""
    x = torch.randn(512, 64)
    kw = {"method": method, "profile": "model", "time_limit": 10, "stores": stores}
    kept = wrap_module.wrap(blocks(), (x,), {"cpu:0": fits}, **kw)
    assert not holds.held_steps(kept.graph, kept.plan)
    tight_plan = wrap_module.wrap(blocks(), (x,), {"cpu:0": tight}, **kw)
    assert holds.held_steps(tight_plan.graph, tight_plan.plan)


def at_the_boundary() -> tuple:
    """A wrapped step at 82% (only a release fits) run up to the autograd boundary: the module, its input, its
    executor, the run, the tensor the caller holds and the step that refills it."""
    from xsched.capture.torch import bind_inputs

    x = torch.randn(512, 64)
    w = wrap_module.wrap(blocks(), (x,), {"cpu:0": "82%"}, method="checkpoint", profile="model")
    (refill,) = [i for i, (k, _) in holds.held_steps(w.graph, w.plan).items() if k == "refill"]
    (v,) = w.graph.held_outputs
    ex = Executor(w.graph, w.plan)
    st = ex.start(bind_inputs(w.graph, w.module, (x,)))
    ex.run(st, 0, w.plan.boundary)
    return w, x, ex, st, st.stores["cpu:0"].tensors[v], refill


def test_the_callers_storage_is_empty_between_release_and_refill() -> None:
    """The release frees the bytes the caller holds, not a copy of them: run up to the refill, the caller's tensor
    has an empty storage; after it, the same storage holds the value."""
    w, x, ex, st, caller, refill = at_the_boundary()
    ex.run(st, w.plan.boundary, refill)
    assert caller.untyped_storage().nbytes() == 0
    ex.run(st, refill)
    assert (
        st.stores["cpu:0"].tensors[w.graph.held_outputs[0]] is caller
        and caller.untyped_storage().nbytes() == caller.nbytes
    )
    assert_close(caller, w.module(x).detach())


def test_a_run_stopped_between_release_and_refill_leaves_nan_not_an_empty_storage() -> None:
    """An error after the release (here a step that raises) must not leave the caller a tensor over an empty storage,
    which reads past its end: it gets its bytes back, as NaN."""
    w, x, ex, st, caller, refill = at_the_boundary()

    def fails(st: object) -> None:
        raise XschedError("a step failed", stage="execute")

    ex.fns[refill - 1] = fails
    with pytest.raises(XschedError, match="a step failed"):
        ex.run(st, w.plan.boundary, trace=True)
    assert caller.untyped_storage().nbytes() == caller.nbytes and caller.isnan().all()


def test_memory_the_output_does_not_own_is_kept_not_emptied() -> None:
    """A storage that cannot be resized (memory from numpy, say) is not emptied: the release keeps it, as any free
    of a held tensor, and the refill writes into it as it is."""
    import numpy as np

    from xsched.contracts.plan import Free
    from xsched.execute.held import _refilled, _release
    from xsched.execute.steps import RunState
    from xsched.execute.stores import DeviceStore

    t = torch.from_numpy(np.ones(8, np.float32))
    st = RunState({"cpu:0": DeviceStore("cpu:0", torch.device("cpu"), {"v": t.nbytes})})
    st.stores["cpu:0"].put("v", t)
    _release(Free("v", "cpu:0"))(st)
    assert t.untyped_storage().nbytes() == t.nbytes and st.stores["cpu:0"].bytes == 0
    assert _refilled(st, "v", "cpu:0") is t and (t == 1).all()


def test_an_output_left_on_the_store_is_copied_back_at_the_end() -> None:
    """A plan that parks the held output and never brings it back would leave the caller's storage empty: the hold
    rule appends the copy back."""
    x = torch.randn(512, 64)
    w = wrap_module.wrap(blocks(), (x,), {"cpu:0": "80%"}, method="park", profile="model", stores=("cpu:1",))
    (i,) = [i for i, (k, _) in holds.held_steps(w.graph, w.plan).items() if k == "refill"]
    back = w.plan.steps[i]
    cut = dataclasses.replace(w.plan, steps=w.plan.steps[:i] + w.plan.steps[i + 1 :])
    assert hold_to_end(w.graph, cut).steps[-1] == Copy(back.value, back.src, back.dst)


@pytest.mark.parametrize("addresses", [True, "whole"], ids=["handed", "whole"])
def test_planned_addresses_run_a_release_as_eager(addresses: bool | str) -> None:
    """With planned addresses the held output lives outside the arena (it crosses the boundary), so a release
    empties only the caller's storage; a whole-step run hands nothing over, and its frees are plain. Both give
    eager's output and gradients."""
    x = torch.randn(512, 64)
    eager = blocks()
    model = copy.deepcopy(eager)
    w = wrap_module.wrap(model, (x,), {"cpu:0": "82%"}, method="checkpoint", profile="model")
    assert holds.held_steps(w.graph, w.plan)
    from xsched.capture.torch import bind_inputs

    ex = Executor(w.graph, w.plan, planned_addresses=addresses)
    assert bool(ex.held) == (addresses is True)
    trace = ex(bind_inputs(w.graph, model, (x,)))
    ref = eager(x)
    ref.sum().backward()
    (v,) = w.graph.held_outputs
    assert_close(trace.outputs[v], ref.detach())
    for name, p in eager.named_parameters():
        got = trace.outputs[w.graph.grads[name]["ref"]]  # before the ref's view: the same elements
        assert_close(got.reshape(p.grad.shape), p.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "budgets,method,stores,refill",
    [({"cuda:0": "82%"}, "checkpoint", (), Compute), ({"cuda:0": "80%"}, "park", ("cpu",), Copy)],
    ids=["recomputed", "parked"],
)
def test_on_a_gpu_a_released_output_comes_back_as_eager_made_it(
    budgets: dict, method: str, stores: tuple, refill: type
) -> None:
    """The CUDA path: the release frees the caller's block with the copy out still reading it (record_stream), the
    refill writes it on the copy lane's stream or the compute stream. Three steps of SGD, the caller's output read
    after each backward, against eager on the same GPU."""
    torch.manual_seed(0)
    eager = blocks().cuda()
    model = copy.deepcopy(eager)
    x = torch.randn(512, 64, device="cuda")
    w = wrap_module.wrap(model, (x,), budgets, method=method, profile="model", time_limit=10, stores=stores)
    kinds = {(k, type(w.plan.steps[i])) for i, (k, _) in holds.held_steps(w.graph, w.plan).items()}
    assert ("refill", refill) in kinds, kinds
    outs: dict[str, list[torch.Tensor]] = {"eager": [], "xsched": []}
    for name, m in (("eager", eager), ("xsched", w)):
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        for _ in range(3):
            opt.zero_grad()
            out = m(x)
            out.square().mean().backward()
            outs[name].append(out.detach().clone())  # read after backward: refilled
            opt.step()
    for got, want in zip(outs["xsched"], outs["eager"]):
        assert_close(got, want, rtol=1e-4, atol=1e-5)
    for p, q in zip(model.parameters(), eager.parameters()):
        assert_close(p, q, rtol=1e-4, atol=1e-5)


def pinned_here(task: int) -> bool:
    return holds.all_pinned()


def test_hier_worker_processes_plan_held_outputs_as_the_runner_asked() -> None:
    """A worker process does not share the runner's context: the pool tells it whether held outputs are pinned."""
    from xsched.solve.hier.blocks import BlockPool

    pool = BlockPool(2, 2)
    with pool as run:
        with holds.holds_pinned():
            assert run(pinned_here, [0, 1]) == [True, True]
        assert run(pinned_here, [0, 1]) == [False, False]
