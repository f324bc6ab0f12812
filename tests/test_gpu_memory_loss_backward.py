"""scripts/bench_gpu_memory.py --loss-backward on logical CPUs: every row's step is `loss.backward()` (the torch rows
backpropagate the loss alone, the xsched graph has the loss's tangent alone, budgets of its own eager peak, lower by
the logits' tangent), the rows train to eager's loss, and the steps' gradients are eager `loss.backward()`'s."""

from __future__ import annotations

import contextlib
import gzip
import json
import re
import sys
import time
import types
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.testing import assert_close

from xsched import zoo
from xsched.capture.torch import bind_inputs, capture, unpack_outputs
from xsched.contracts.graph import Graph
from xsched.errors import CaptureError
from xsched.execute import segments as segments_module
from xsched.execute.reference import run_plan
from xsched.pipeline import solve_plan
from xsched.profiling.model import cost_profile
from xsched.solve.reference import eager_peak

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import bench_gpu_compiled_rows as compiled_rows  # noqa: E402
import bench_gpu_memory as bench  # noqa: E402
import bench_gpu_plan_rows as plan_rows  # noqa: E402
import bench_gpu_torch_rows as torch_rows  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

BATCH = 8


def tiny() -> zoo.ZooModel:
    return zoo.build("gpt2", batch=BATCH, scale="tiny")


def eager_grads(model: nn.Module, inputs: tuple, every: bool) -> dict[str, torch.Tensor]:
    """Eager PyTorch's gradients: `loss.backward()`, or (`every`) ones into the logits and the loss."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(torch_rows.SEED)
    logits, loss = model(*inputs)
    if every:
        torch.autograd.backward([logits, loss], [torch.ones_like(logits), torch.ones_like(loss)])
    else:
        loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return grads


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("loss_backward")
    argv = ["--device", "cpu", "--scale", "tiny", "--batch", str(BATCH), "--budgets", "60", "--iters", "1"]
    argv += ["--warmup", "1", "--time-limit", "2", "--profile-s", "10", "--jobs", "1", "--no-compile"]
    argv += ["--loss-backward", "--json", str(out / "run.json"), "--out", str(out / "run.md")]
    assert bench.main([*argv, "--save-profile", str(out)]) == 0
    graph = Graph.from_dict(json.loads(gzip.open(out / "gpt2-tiny.graph.json.gz", "rt").read()))
    return out, json.loads((out / "run.json").read_text()), graph


def test_the_captured_step_differentiates_the_loss_alone(run):
    out, got, graph = run
    tangents = [graph.value[v] for v in graph.inputs if graph.value[v].kind == "tangent"]
    assert [(t.name, t.shape) for t in tangents] == [("tangent:1", ())]  # the loss's, a scalar
    assert len(graph.forward_outputs) == 2  # the logits are still an output, kept
    z = tiny()
    every = capture(z.model, z.inputs, grad_outputs="all")  # the default step's graph
    logits_bytes = z.model(*z.inputs)[0].numel() * 4  # eager's logits, float32: the tangent the default has
    assert logits_bytes == BATCH * 16 * 64 * 4  # hand count: tiny's 16 positions, vocabulary 64
    assert eager_peak(every) - eager_peak(graph) == logits_bytes
    resident_every = sum(every.value[v].nbytes for v in every.inputs)
    assert resident_every - got["facts"]["resident"] == logits_bytes
    rows = {r["plan"]: r for r in got["rows"]}
    for name in ("xsched 60%, cpu:0 alone", "xsched 60%, cpu:1 store"):  # % of this step's own eager peak
        assert rows[name]["budget"] == eager_peak(graph) * 60 // 100, name
    assert got["facts"]["loss_backward"] is True and got["facts"]["step"].startswith("loss.backward()")
    md = (out / "run.md").read_text()
    assert md.startswith("# GPU memory benchmark: gpt2-tiny, batch 8, cpu:0 + the cpu:1 store, step loss.backward()")
    assert "Step: forward, then loss.backward(): the loss alone backpropagated" in " ".join(md.split())  # the notes


def test_every_row_trains_to_eager_loss(run):
    _, got, _ = run
    rows = {r["plan"]: r for r in got["rows"]}
    assert list(rows)[:4] == [
        "eager PyTorch",
        "torch.utils.checkpoint per block",
        "save_on_cpu(pin_memory=True)",
        "torchtune OffloadActivations",
    ]
    assert {k for k in rows if k.startswith("xsched")} == {
        "xsched eager plan",
        "xsched 60%, cpu:0 alone",
        "xsched 60%, cpu:1 store",
        "xsched at checkpoint's peak, cpu:0 alone",
    }
    z = tiny()
    torch.manual_seed(torch_rows.SEED)  # as the benchmark seeds every step (dropout)
    want = float(z.model(*z.inputs)[1].detach())
    resident = got["facts"]["resident"]
    for name, row in rows.items():
        if name == "torchtune OffloadActivations":
            continue
        if name == "xsched 60%, cpu:0 alone" and "no plan" in row.get("error", ""):  # 2 s of `auto` under load
            continue
        assert "error" not in row, row
        assert row["loss"] == pytest.approx(want, rel=1e-5, abs=1e-6), name
        if name.startswith("xsched 60%"):
            assert row["peak"] + resident <= row["budget"], name  # the executor's bytes on cpu:0


def test_the_torch_step_backpropagates_the_loss_alone_and_keeps_the_logits():
    z = tiny()
    model, inputs = z.model, tuple(z.inputs)
    ones = torch_rows.ones_for(model, inputs, loss_backward=True)
    assert [o.shape for o in ones] == [torch.Size([])]
    torch.manual_seed(torch_rows.SEED)
    b = torch_rows.torch_step(model, inputs, ones, contextlib.nullcontext, loss_backward=True)()
    assert [o.shape for o in b.keep] == [torch.Size([BATCH, 16, 64]), torch.Size([])]  # the logits held until after
    b.backward()
    got = {n: p.grad for n, p in model.named_parameters()}
    want, every = eager_grads(model, inputs, every=False), eager_grads(model, inputs, every=True)
    for n, g in got.items():
        assert_close(g, want[n], rtol=1e-6, atol=1e-7, msg=lambda m, n=n: f"{n}: {m}")
    assert not torch.allclose(got["ln_f.weight"], every["ln_f.weight"])  # ones into the logits flow back through it
    assert len(torch_rows.ones_for(model, inputs, loss_backward=False)) == 2  # without the flag: both outputs


def test_the_xsched_graph_computes_loss_backward_gradients():
    z = tiny()
    graph = plan_rows.captured(z.model, tuple(z.inputs), "gpt2-tiny", loss_backward=True)
    plan = solve_plan(graph, {"cpu": "100%"}, method="eager", profile="model")
    torch.manual_seed(torch_rows.SEED)
    got = unpack_outputs(graph, run_plan(graph, plan, bind_inputs(graph, z.model, tuple(z.inputs))))
    want = eager_grads(z.model, tuple(z.inputs), every=False)
    assert set(got.grads) == set(want)
    for n, g in want.items():
        assert_close(got.grads[n], g, rtol=1e-5, atol=1e-6, msg=lambda m, n=n: f"{n}: {m}")


class LogitsOnly(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


class LossFirst(LogitsOnly):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = self.lin(x)
        return y.square().mean(), y


@pytest.mark.parametrize(
    ("model", "says"),
    [
        (LogitsOnly(), "m differentiates ['tangent:0'], not its last output alone as a scalar loss (tangent:0)"),
        (LossFirst(), "m differentiates ['tangent:0'], not its last output alone as a scalar loss (tangent:1)"),
    ],
)
def test_a_model_without_a_scalar_last_output_is_a_one_line_error(model, says):
    with pytest.raises(CaptureError, match=re.escape(f"[capture] --loss-backward: {says}")) as e:
        plan_rows.captured(model, (torch.randn(2, 4),), "m", loss_backward=True)
    assert "\n" not in str(e.value)


def test_compiled_rows_step_loss_backward(monkeypatch):
    """The xsched compiled rows (wrap(compile=True); regions run as their fx graphs, no inductor: fast) with
    --loss-backward train to eager `loss.backward()`'s loss within their budgets."""
    monkeypatch.setattr(segments_module, "_inductor", lambda gm, inputs: torch.fx.Interpreter(gm).boxed_run)
    z = tiny()
    model, inputs = z.model, tuple(z.inputs)
    graph = plan_rows.captured(model, inputs, "gpt2-tiny", loss_backward=True)
    profile = cost_profile(graph, ["cpu:0"], ["cpu:1"])
    ones = torch_rows.ones_for(model, inputs, loss_backward=True)
    eager_step = torch_rows.torch_step(model, inputs, ones, contextlib.nullcontext, loss_backward=True)
    eager = torch_rows.backward_of(eager_step, model)
    a = types.SimpleNamespace(time_limit=1.0, iters=1, warmup=1, deadline=600.0, loss_backward=True)
    plans = {"xsched 80%, cpu:1 store": ({"cpu:0": "80%", "cpu:1": "100%"}, ["cpu:0", "cpu:1"])}
    (row,) = compiled_rows.compiled_plan_rows(model, inputs, profile, plans, "cpu:1", eager, a, time.perf_counter())
    assert "error" not in row, row
    torch.manual_seed(torch_rows.SEED)
    assert row["loss"] == pytest.approx(eager(), rel=1e-5)
    resident = sum(graph.value[v].nbytes for v in graph.inputs)
    assert row["budget"] == eager_peak(graph) * 80 // 100  # the loss-alone graph's: wrap captured it alike
    assert 0 < row["predicted_peak"] <= row["budget"] - resident
