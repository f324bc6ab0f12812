"""Dropout captured for a GPU from CPU tensors records CUDA's fused kernel (`native_dropout`: one op, a bool mask),
not the CPU's four ops with a float mask; the graph still runs as eager PyTorch on the CPU (the CPU's
`native_dropout` draws the mask its own dropout draws), recomputed dropout included; a graph for the CPU is as
before, a capture for one target is not reused for the other, the capture for CUDA is the graph the H100 captured,
and `xsched run` still takes a plan made for a graph file captured for the CPU."""

from __future__ import annotations

import copy
import gzip
import importlib
import json
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.testing import assert_close

from xsched import zoo
from xsched.capture import bind_inputs, capture, unpack_outputs
from xsched.capture.chunk_loss import chunk_cross_entropy
from xsched.capture.reuse import captured_once
from xsched.contracts.graph import Graph
from xsched.contracts.plan import Compute
from xsched.contracts.random_ops import random_ops
from xsched.execute.executor import Executor
from xsched.profiling.model import cost_profile
from xsched.solve.api import solve

ROOT = Path(__file__).resolve().parents[1]
DROPOUT_TARGETS = ("aten.native_dropout.default", "aten.bernoulli.p", "aten.empty_like.default")


def dropout_ops(graph) -> Counter:
    return Counter(o.target for o in graph.ops if o.target in DROPOUT_TARGETS)


def test_a_gpu_target_records_the_fused_kernel_and_its_bool_mask() -> None:
    """gpt2 tiny has 7 dropouts: for a GPU each is one native_dropout whose mask is 1 byte an element (its output's
    element count); for the CPU, empty_like and bernoulli each, as before."""
    z = zoo.build("gpt2", scale="tiny")
    cpu, gpu = capture(z.model, z.inputs), capture(z.model, z.inputs, device_type="cuda")
    assert dropout_ops(cpu) == Counter({"aten.empty_like.default": 7, "aten.bernoulli.p": 7})
    assert dropout_ops(gpu) == Counter({"aten.native_dropout.default": 7})
    assert sum(o.target == "aten.native_dropout_backward.default" for o in gpu.ops) == 7
    for op in (o for o in gpu.ops if o.target == "aten.native_dropout.default"):
        out, mask = (gpu.value[v] for v in op.outputs)
        assert mask.dtype.endswith("bool") and mask.shape == out.shape
        assert mask.nbytes * 4 == out.nbytes  # float32 activations: the mask is a quarter of their bytes
    assert len(gpu.ops) == len(cpu.ops) - 21  # each dropout: 4 ops forward, 1 backward, against 1 and 1


class Dropouts(nn.Module):
    """Each way a model asks for dropout: the module, F.dropout by keyword, torch.dropout, F.dropout in place
    (unfused on CUDA too), and p = 0 and p = 1 (no mask drawn)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 4)
        self.drop = nn.Dropout(0.25)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(torch.tanh(self.fc1(x)))
        h = F.dropout(h, p=0.5, training=self.training) + torch.dropout(h, 0.1, self.training)
        h = F.dropout(h * 1.0, 0.3, self.training, inplace=True)
        return self.fc2(F.dropout(h, 0.0) + F.dropout(h, 1.0))


def test_each_way_to_ask_for_dropout_is_fused_where_aten_fuses_it() -> None:
    torch.manual_seed(0)
    graph = capture(Dropouts(), (torch.randn(8, 16),), device_type="cuda")
    assert sum(o.target == "aten.native_dropout.default" for o in graph.ops) == 3
    assert sum(o.target == "aten.bernoulli.p" for o in graph.ops) == 1  # the in-place one


@pytest.mark.parametrize("model_name", ["gpt2", "dropouts"])
def test_a_graph_captured_for_a_gpu_runs_as_eager_on_the_cpu_recomputing_its_dropouts(model_name: str) -> None:
    """The graph for a GPU, run on the CPU by a plan that frees and recomputes activations (dropouts among them,
    replayed from the generator state they first drew from): outputs and every gradient equal eager PyTorch's on
    the CPU from the same seed."""
    if model_name == "gpt2":
        z = zoo.build("gpt2", scale="tiny")
        model, inputs = z.model, z.inputs
    else:
        torch.manual_seed(0)
        model, inputs = Dropouts(), (torch.randn(8, 16),)
    graph = capture(model, inputs, device_type="cuda")
    plan = solve(graph, cost_profile(graph, ["cpu"]), {"cpu": "100%"}, ["cpu"], "sqrt")
    computes = Counter(s.op for s in plan.steps if isinstance(s, Compute))
    assert any(computes[o] > 1 for o in random_ops(graph)), "the plan recomputes a dropout"
    eager = copy.deepcopy(model)
    torch.manual_seed(11)
    want = [o for o in eager(*inputs) if o.requires_grad] if model_name == "gpt2" else [eager(*inputs)]
    torch.autograd.backward(want, [torch.ones_like(o) for o in want])
    torch.manual_seed(11)
    got = unpack_outputs(graph, Executor(graph, plan)(bind_inputs(graph, model, inputs)).outputs)
    for a, b in zip([o for o in got.outputs if o.is_floating_point()], want):
        assert_close(a, b.detach())
    for name, p in eager.named_parameters():
        assert_close(got.grads[name], p.grad, msg=name)


def test_a_capture_for_one_target_is_not_reused_for_the_other() -> None:
    """Within one capture scope (as `xsched train` plans, then wraps), the GPU's graph and the CPU's differ."""
    z = zoo.build("gpt2", scale="tiny")
    with captured_once():
        gpu = capture(z.model, z.inputs, device_type="cuda")
        cpu = capture(z.model, z.inputs, device_type="cpu")
        again = capture(z.model, z.inputs, device_type="cuda")
    assert dropout_ops(gpu) != dropout_ops(cpu) and again is gpu


def test_the_cpu_capture_for_a_gpu_records_what_the_h100_recorded() -> None:
    """GPT-2 (6 layers, batch 8, T1024, dropout 0.1) captured from CPU tensors for CUDA against the graph the lent
    H100 captured from GPU tensors (benchmarks/gpu/, 2026-11-27): op for op the same aten ops, value for value the
    same dtypes, shapes and bytes (for the CPU, 57 more ops and 1.9 GiB more at the eager peak), and the same
    fingerprint, device literals included; its loss in 8 chunks as the H100's chunked graph."""
    z = zoo.build("gpt2", batch=8, scale="full:n_layer=6")
    ours = capture(z.model, z.inputs, device_type="cuda")
    for graph, name in ((ours, "gpt2-full_n_layer6"), (chunk_cross_entropy(ours, 8), "gpt2-full_n_layer6-chunk8")):
        stored = ROOT / "benchmarks" / "gpu" / f"{name}.h100-20261127.graph.json.gz"
        h100 = Graph.from_dict(json.loads(gzip.decompress(stored.read_bytes())))
        assert [o.target for o in graph.ops] == [o.target for o in h100.ops], name
        shapes = [(v.dtype, v.shape, v.nbytes) for v in h100.values]
        assert [(v.dtype, v.shape, v.nbytes) for v in graph.values] == shapes, name
        assert graph.fingerprint == h100.fingerprint, name  # `arange`'s device too: the H100's profiles apply


def test_xsched_run_takes_a_plan_made_for_a_cpu_typed_graph_file_on_gpu_devices(tmp_path, monkeypatch, capsys) -> None:
    """`xsched capture` writes the CPU's graph unless told `--device-type cuda`; a plan made for that file on a GPU
    still runs under `xsched run`, which captures for the plan's devices first (here patched to say a GPU: there
    is none), then as the file was captured. A plan for neither graph is one line and exit 2."""
    import xsched.devices.spec as spec
    from xsched.cli import main
    from xsched.solve.reference import eager_plan

    z = zoo.build("gpt2", scale="tiny")
    eager_plan(capture(z.model, z.inputs), "cpu").save(tmp_path / "plan.json")
    monkeypatch.setattr(spec, "target_device_type", lambda devices: "cuda")
    argv = ["run", "zoo:gpt2", str(tmp_path / "plan.json"), "--scale", "tiny", "--iters", "1", "--warmup", "0"]
    assert main(argv) == 0
    assert "iteration time" in capsys.readouterr().out
    assert main([*argv, "--batch", "3"]) == 2
    assert "plan it again" in capsys.readouterr().err


def test_wrap_takes_a_plan_made_for_a_cpu_typed_graph_file_on_gpu_devices(monkeypatch) -> None:
    """The same for `wrap(..., plan=)`: its devices say a GPU (patched), the plan was made for the CPU's graph, and
    the wrapped model trains as eager PyTorch from the same seed."""
    from xsched.solve.reference import eager_plan

    wrap_module = importlib.import_module("xsched.execute.wrap")  # the package exports `wrap`, the function
    torch.manual_seed(0)
    model, x = Dropouts(), torch.randn(8, 16)
    plan = eager_plan(capture(model, (x,)), "cpu")
    monkeypatch.setattr(wrap_module, "target_device_type", lambda devices: "cuda")
    eager = copy.deepcopy(model)
    w = wrap_module.wrap(model, (x,), {"cpu": "100%"}, plan=plan)
    assert w.device_type == "cuda"
    for m in (w, eager):
        torch.manual_seed(5)
        m(x).square().sum().backward()
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        assert_close(p.grad, q.grad, msg=name)


def test_wrap_given_a_plan_for_another_model_says_so_in_one_line() -> None:
    from xsched.errors import PlanError
    from xsched.execute.wrap import wrap
    from xsched.solve.reference import eager_plan

    torch.manual_seed(0)
    other = eager_plan(capture(nn.Sequential(nn.Linear(16, 4)), (torch.randn(8, 16),)), "cpu")
    with pytest.raises(PlanError, match="plan it again for this model") as e:
        wrap(Dropouts(), (torch.randn(8, 16),), {"cpu": "100%"}, plan=other)
    assert "\n" not in str(e.value) and e.value.stage == "execute"
