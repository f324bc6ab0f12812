"""The GPU memory benchmark's xsched compiled rows (scripts/bench_gpu_compiled_rows.py) on logical CPUs, regions
"compiled" as their fx graphs (no inductor: fast): each row runs, trains like eager PyTorch and predicts a peak
within its budget (the allocator's count of a gpt2 step also holds dropout's and the embedding backward's scratch,
beyond the plan's values: tests/test_compile_plan.py checks that count on a model without them)."""

from __future__ import annotations

import contextlib
import sys
import time
import types
from pathlib import Path

import pytest
import torch

from xsched import zoo
from xsched.capture.torch import capture
from xsched.execute import segments as segments_module
from xsched.profiling.model import cost_profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import bench_gpu_compiled_rows as rows_module  # noqa: E402
import bench_gpu_torch_rows as torch_rows  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def as_is(gm: torch.fx.GraphModule, inputs: list) -> object:
    """A region run as its fx graph, each value freed after its last use (boxed: the inputs too)."""
    return lambda args: torch.fx.Interpreter(gm).boxed_run(args)


def test_compiled_rows_train_like_eager_within_their_budgets(monkeypatch) -> None:
    monkeypatch.setattr(segments_module, "_inductor", as_is)
    z = zoo.build("gpt2", scale="tiny")
    model, inputs = z.model, tuple(z.inputs)
    graph = capture(model, inputs)
    profile = cost_profile(graph, ["cpu:0"], ["cpu:1"])
    ones = [torch.ones_like(o) for o in torch_rows._tensor_leaves(model(*inputs)) if o.requires_grad]
    eager = torch_rows.backward_of(torch_rows.torch_step(model, inputs, ones, contextlib.nullcontext), model)
    a = types.SimpleNamespace(time_limit=1.0, iters=1, warmup=1, deadline=600.0, loss_backward=False)
    plans = {
        "xsched 80%, cpu:0 alone": ({"cpu:0": "80%"}, ["cpu:0"]),
        "xsched 80%, cpu:1 store": ({"cpu:0": "80%", "cpu:1": "100%"}, ["cpu:0", "cpu:1"]),
    }
    got = rows_module.compiled_plan_rows(model, inputs, profile, plans, "cpu:1", eager, a, time.perf_counter())
    rows = {r["plan"]: r for r in got}
    assert list(rows) == ["xsched compiled 80%, cpu:0 alone", "xsched compiled 80%, cpu:1 store"]
    torch.manual_seed(torch_rows.SEED)
    want = eager()
    resident = sum(graph.value[v].nbytes for v in graph.inputs)
    for name, row in rows.items():
        assert "error" not in row, row
        assert row["loss"] == pytest.approx(want, rel=1e-5), name  # same dropout draws, the same aten calls
        assert 0 < row["predicted_peak"] <= row["budget"] - resident, name
        assert all(n.startswith("xsched: ") for n in row["notices"])
    alone, store = rows["xsched compiled 80%, cpu:0 alone"], rows["xsched compiled 80%, cpu:1 store"]
    # at 80% each plan must recompute or park; whether `auto`'s 1 s finds the store plan that parks or one that
    # recomputes depends on the machine's load
    assert alone["recomputes"] > 0 and store["copies"] + store["recomputes"] > 0 and alone["peak"] > 0
