"""scripts/bench_setup_plan.py: a model built empty (meta device, then uninitialised memory) captures to the graph
of the model `xsched train` builds, tied weights included, in fp32 and in bf16 under the run's autocast; and
scripts/bench_setup_session.py times each stage of the session's own setup once."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from xsched.capture.torch import capture
from xsched.train.optim import autocast
from xsched.train.plan_wrap import grad_outputs

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import bench_setup_plan as bench  # noqa: E402


def _graph(name: str, scale: str, precision: str, empty: bool):
    task = bench.load_task(name, scale, precision, empty)
    with autocast(precision, ("cuda",)):
        return capture(task.model, task.example_batch[0], grad_outputs=grad_outputs(task))


@pytest.mark.parametrize(
    ("name", "scale", "precision"), [("llama", "tiny", "bf16"), ("gpt2", "small:n_layer=2,dropout=0.0", "fp32")]
)
def test_empty_model_captures_the_built_models_graph(name, scale, precision):
    built = _graph(name, scale, precision, empty=False)
    empty = _graph(name, scale, precision, empty=True)
    assert empty.fingerprint == built.fingerprint


def test_empty_model_keeps_ties_and_shapes():
    from xsched import zoo

    model = bench.empty_model("llama", "tiny", torch.bfloat16)
    built = zoo.build_module("llama", "tiny").to(torch.bfloat16)
    assert model.lm_head.weight is model.embed_tokens.weight
    shapes = lambda m: [(k, p.shape, p.dtype) for k, p in m.named_parameters(remove_duplicate=False)]  # noqa: E731
    assert shapes(model) == shapes(built)
    assert all(p.device.type == "cpu" for p in model.parameters())


def test_the_session_bench_times_each_stage_of_prepare_and_puts_them_back(monkeypatch, capsys, tmp_path):
    import bench_setup_session as session_bench

    from xsched.train import session

    before = session.load_task
    argv = ["bench_setup_session.py", "--scale", "tiny", "--budget", "100%", "--cache", str(tmp_path)]
    monkeypatch.setattr(sys, "argv", argv)
    session_bench.main()
    labels = [line.split()[0] for line in capsys.readouterr().out.splitlines()]
    assert labels == ["model", "loss", "capture", "plan", "wrap", "optimizer", "prepare"]
    assert session.load_task is before
