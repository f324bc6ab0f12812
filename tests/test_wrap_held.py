"""Outputs the caller holds through backward (`wrap`'s hold_outputs): the predicted peak against an allocator-level
count of a wrapped training step, `logits = model(x); loss(logits).backward()`, and its gradients against eager."""

from __future__ import annotations

import copy
import importlib

import pytest
import torch
from torch import nn
from torch.testing import assert_close

from xsched.capture.torch import bind_inputs
from xsched.contracts.plan import Compute, Copy, Free
from xsched.execute.executor import Executor
from xsched.execute.live_bytes import LiveBytes, _named, measured_peaks
from xsched.execute.steps import prepare_compute, prepare_copy, prepare_free
from xsched.execute.wrap_graph import held_by_caller

pytestmark = pytest.mark.usefixtures("one_thread")
wrap_module = importlib.import_module("xsched.execute.wrap")


def blocks() -> nn.Module:
    """Linear-Tanh x4: tanh's backward reads its output, so backward reads the model's output too."""
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(64, 64), nn.Tanh())])


def counting(monkeypatch: pytest.MonkeyPatch, count: LiveBytes) -> None:
    """wrap's executors tell `count` each step's device (a copy's destination) and hand back to "caller" after
    each run, so what the caller's code allocates between them is counted apart."""

    def executor(graph, plan, **kwargs):  # noqa: ANN001, ANN003, ANN202
        kwargs.pop("table", None)
        table = {
            Compute: _named(prepare_compute, lambda s: s.device, count),
            Copy: _named(prepare_copy, lambda s: s.dst, count),
            Free: _named(prepare_free, lambda s: s.device, count),
        }
        ex = Executor(graph, plan, table=table, overlap=False, **kwargs)
        run = ex.run

        def run_then_caller(*args, **kw):  # noqa: ANN002, ANN003, ANN202
            try:
                return run(*args, **kw)
            finally:
                count.device = "caller"

        ex.run = run_then_caller
        return ex

    monkeypatch.setattr(wrap_module, "Executor", executor)


def step_peaks(w: nn.Module, x: torch.Tensor, count: LiveBytes) -> dict[str, int]:
    """One step whose caller holds the output through backward; per plan device, the most bytes counted live
    above the parameters and the input (there before the step, as the plan's homed inputs are)."""
    count.device = "caller"
    with count:
        for t in [*w.parameters(), *w.buffers(), x]:
            count.track(t, "-")
        count.reset_peak()
        out = w(x)
        out.square().mean().backward()
        del out
    return {d: count.peak.get(d, 0) for d in w.plan.devices}


def predicted_above_homes(w: nn.Module) -> dict[str, int]:
    g, plan = w.graph, w.plan
    homed = {d: sum(g.value[v].nbytes for v, h in plan.homes.items() if h == d) for d in plan.devices}
    return {d: plan.predicted.peak_bytes[d] - homed[d] for d in plan.devices}


@pytest.mark.parametrize(
    "budgets,method,stores",
    [
        ({"cpu:0": "90%"}, "checkpoint", ()),
        ({"cpu:0": "90%", "cpu:1": "100%"}, "greedy", ()),
        ({"cpu:0": "92%"}, "gaps", ()),
        ({"cpu:0": "88%"}, "park", ("cpu:1",)),  # parks and reruns planned with the hold (refused before it)
    ],
    ids=["cpu0", "cpu0+cpu1", "gaps", "park"],
)
def test_a_held_output_is_counted_and_trains_like_eager(
    monkeypatch: pytest.MonkeyPatch, budgets: dict, method: str, stores: tuple
) -> None:
    """The predicted peak per device is the counted one, within the 3% of the plan-level fidelity test
    (tests/test_live_bytes.py; this plan's simulator counts 16 KiB that neither run holds), the wrapped step's count
    is the executor's alone (0.5%: the caller's hold adds nothing the plan left out), and the gradients are eager's."""
    count = LiveBytes()
    counting(monkeypatch, count)
    eager = blocks()
    model = copy.deepcopy(eager)
    x = torch.randn(512, 64)
    w = wrap_module.wrap(model, (x,), budgets, method=method, profile="model", time_limit=10, stores=stores)
    assert w.graph.held_outputs and not w.plan.solver.repaired  # the output is held, the plan needed no repair
    got, want = step_peaks(w, x, count), predicted_above_homes(w)
    monkeypatch.undo()
    alone = measured_peaks(w.graph, w.plan, bind_inputs(w.graph, model, (x,)))
    for d in w.plan.devices:
        assert abs(got[d] - want[d]) <= 0.03 * max(want[d], got[d]), (d, want[d], got[d])
        assert abs(got[d] - alone[d]) <= 0.005 * max(alone[d], 1), (d, alone[d], got[d])
    eager(x).square().mean().backward()
    for (n, p), q in zip(model.named_parameters(), eager.parameters()):
        assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=lambda m, n=n: f"grad {n}: {m}")


def test_an_output_freed_under_the_callers_hold_is_what_was_undercounted(monkeypatch: pytest.MonkeyPatch) -> None:
    """The oracle's teeth: with hold_outputs=False the plan evicts the output after backward read it and recomputes
    it at the end into a new tensor, so a caller that keeps it runs above the prediction by the output's bytes
    (held, the same budget fits by emptying the caller's storage instead: tests/test_held_release.py)."""
    count = LiveBytes()
    counting(monkeypatch, count)
    x = torch.randn(512, 64)
    w = wrap_module.wrap(blocks(), (x,), {"cpu:0": "82%"}, method="checkpoint", profile="model", hold_outputs=False)
    assert w.plan.solver.stats.variant == "evict outputs" and not w.graph.held_outputs
    got, want = step_peaks(w, x, count), predicted_above_homes(w)
    out_bytes = 512 * 64 * 4
    assert got["cpu:0"] - want["cpu:0"] >= out_bytes


def test_held_outputs_survive_json_and_keep_the_fingerprint() -> None:
    """The fact travels with the graph file; profiles measured for the graph (keyed by fingerprint) still match."""
    from xsched.capture.torch import capture
    from xsched.contracts.graph import Graph, GraphError

    g = capture(blocks(), (torch.randn(8, 64),))
    held = held_by_caller(g)
    assert held.held_outputs and held.fingerprint == g.fingerprint
    assert Graph.from_dict(held.to_dict()).held_outputs == held.held_outputs
    with pytest.raises(GraphError, match="held output"):
        Graph.from_dict({**g.to_dict(), "held_outputs": [g.inputs[0]]})
