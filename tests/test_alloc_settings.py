"""The executor's expandable_segments option (xsched.execute.alloc_settings): set for GPUs only, a no-op on CPUs."""

from __future__ import annotations

import json

import pytest
import torch
from executor_support import TWO, ZOO, eager_plan_on, workload

from xsched.capture.torch import bind_inputs
from xsched.execute.alloc_settings import use_expandable_segments
from xsched.execute.executor import Executor

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def settings(monkeypatch) -> list[str]:
    """The allocator settings asked for (recorded, not applied: this machine may have no GPU)."""
    asked: list[str] = []
    monkeypatch.setattr(torch.cuda.memory, "_set_allocator_settings", asked.append)
    return asked


def test_the_setting_is_made_only_when_a_device_is_a_gpu(settings) -> None:
    assert use_expandable_segments([torch.device("cpu")]) is False and settings == []
    assert use_expandable_segments([torch.device("cpu"), torch.device("cuda:0")]) is True
    assert use_expandable_segments([torch.device("cuda:1")], on=False) is True
    assert settings == ["expandable_segments:True", "expandable_segments:False"]


def test_on_cpu_devices_the_option_changes_nothing(settings) -> None:
    z, graph = workload("gpt2")
    plan = eager_plan_on(graph, TWO)
    env = bind_inputs(graph, z.model, z.inputs)
    runs = []
    for expandable in (False, True):
        ex = Executor(graph, plan, expandable_segments=expandable)
        assert ex.expandable_segments is False  # no GPU among cpu:0 and cpu:1: nothing set
        torch.manual_seed(7)
        runs.append(ex(env, trace=True))
        ex.close()
    assert settings == []
    assert runs[0].resident_after == runs[1].resident_after
    for k, t in runs[0].outputs.items():
        assert torch.equal(t, runs[1].outputs[k])


def test_cli_run_takes_the_option_and_on_cpu_sets_nothing(tmp_path, capsys, settings) -> None:
    from xsched.cli import main

    _, graph = workload("gpt2")
    eager_plan_on(graph, ("cpu:0",)).save(tmp_path / "plan.json")
    batch, scale = ZOO["gpt2"][:2]
    argv = ["run", "zoo:gpt2", str(tmp_path / "plan.json"), "--iters", "1", "--warmup", "1", "--scale", scale]
    assert main([*argv, "--batch", str(batch), "--expandable-segments"]) == 0
    assert "iteration time" in capsys.readouterr().out and settings == []


def test_wrap_passes_the_option_to_its_executors_and_on_cpu_sets_nothing(settings) -> None:
    from torch import nn

    from xsched.execute.wrap import wrap

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    eager = [p.detach().clone().requires_grad_() for p in model.parameters()]
    x = torch.randn(8, 16)
    w = wrap(model, (x,), {"cpu": "100%"}, method="eager", profile="model", expandable_segments=True)
    w(x).sum().backward()
    want = torch.autograd.grad(
        nn.functional.linear(torch.relu(x @ eager[0].T + eager[1]), eager[2], eager[3]).sum(), eager
    )
    for p, g in zip(model.parameters(), want):
        torch.testing.assert_close(p.grad, g)
    assert w.expandable_segments and all(not c.executor.expandable_segments for c in w.compiled.values())
    assert settings == []


def test_cli_train_takes_the_option_and_on_cpu_sets_nothing(tmp_path, capfd, settings) -> None:
    from train_support import EXAMPLE, eager_run

    from xsched.cli import main

    args = ["train", f"{EXAMPLE}:factory", "--budget", "cpu=100%", "--steps", "2", "--batch", "32"]
    args += ["--method", "eager", "--profile", "model", "--cache-dir", str(tmp_path), "--json"]
    assert main([*args, "--expandable-segments"]) == 0
    events = [json.loads(line) for line in capfd.readouterr().out.splitlines() if line.strip()]
    losses = [e["loss"] for e in events if e["event"] == "step"]
    want = eager_run(EXAMPLE, batch=32, world=1, steps=2)[0]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want), rtol=1e-5, atol=1e-6)
    assert settings == []
