"""The host optimizer's modes (issue 30), `cpu:0` computing and `cpu:1` the parameters' home, each against an eager
PyTorch reference that applies the same rule: bf16 weights with fp32 master weights and AdamW state on the store,
the one-step delayed update (ZeRO-Offload's DPU) in fp32 and bf16, resume from a checkpoint in each mode, the
per-step breakdown and its Chrome trace, and the one-line refusals."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from torch import nn
from torch.testing import assert_close
from train_support import assert_offloaded_mlp_trains_as_fused_adamw, teacher_mlp

from xsched.cli import main
from xsched.contracts.plan import Copy, Plan
from xsched.train import TrainConfig, train
from xsched.train.checkpoint import read_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")

MLP = teacher_mlp(4, 128)
LR = 1e-2  # large enough that a step late or a bf16 rounding shows in the losses


@pytest.fixture
def mlp(tmp_path):
    path = tmp_path / "mlp.py"
    path.write_text(MLP)
    return path


def offloaded(mlp, tmp_path, **kw) -> TrainConfig:
    # the weights are 266 KiB in fp32, 133 KiB in bf16: cpu:0 is given about their size and a little more
    budget = "200KiB" if kw.get("precision") == "bf16" else "320KiB"
    return TrainConfig(
        f"{mlp}:factory",
        {"cpu:0": budget, "cpu:1": "1GiB"},
        method="park",
        profile="model",
        cache_dir=str(tmp_path / "cache"),
        param_home="cpu:1",
        stores=("cpu:1",),
        lr=LR,
        **kw,
    )


def eager(steps: int, *, bf16: bool, delayed: bool) -> tuple[list[float], nn.Module, list[torch.Tensor]]:
    """The reference, in plain PyTorch: the model (bf16 under autocast, or fp32) computes; fp32 master weights get
    the gradients (as fp32) and torch's fused AdamW (weight decay 0.01 on 2-D weights); the master is copied into
    the model after each step, or, delayed, after the next step's backward (so step s >= 2 computes with the master
    of step s-1)."""
    ns: dict = {}
    exec(MLP, ns)
    torch.manual_seed(0)
    model, _, loss_fn, batches = ns["factory"](batch=16)
    if bf16:
        model.to(torch.bfloat16)
    params = list(model.parameters())
    master = [nn.Parameter(p.detach().float().clone()) for p in params]
    groups = [
        {"params": [m for m in master if m.dim() >= 2], "weight_decay": 0.01},
        {"params": [m for m in master if m.dim() < 2], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=LR, fused=True)
    losses = []
    for step in range(steps):
        x, y = batches(step, 0, 1)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = loss_fn(model(x), y)
        model.zero_grad()
        loss.backward()
        losses.append(loss.item())
        with torch.no_grad():
            if delayed and step > 0:  # the previous step's update reaches the weights now
                for p, m in zip(params, master):
                    p.copy_(m)
            for p, m in zip(params, master):
                m.grad = p.grad.float()
            opt.step()
            if not delayed:
                for p, m in zip(params, master):
                    p.copy_(m)
    return losses, model, master


@pytest.mark.parametrize(("bf16", "delayed"), [(True, False), (False, True), (True, True)])
def test_each_mode_trains_like_its_eager_reference_and_resumes_exactly(mlp, tmp_path, bf16, delayed) -> None:
    """5 steps straight equal the eager rule's losses and final weights (after the delayed update is flushed), the
    checkpoint holds the fp32 master weights apart from the bf16 ones; 3 steps then 2 resumed give the same losses,
    weights, master weights and AdamW state bit for bit."""
    precision = "bf16" if bf16 else "fp32"
    config = offloaded(mlp, tmp_path, steps=5, precision=precision, delayed_update=delayed)
    whole = train(dataclasses.replace(config, checkpoint_dir=str(tmp_path / "a")))
    want, model, master = eager(5, bf16=bf16, delayed=delayed)
    plain, _, _ = eager(5, bf16=bf16, delayed=not delayed)
    assert_close(whole.losses, want, rtol=1e-5, atol=1e-6)  # the same arithmetic: equal (bf16 too) up to fp32 sums
    assert max(abs(a - b) for a, b in zip(whole.losses, plain)) > 1e-2  # the other rule is far off: it matters
    ck = read_checkpoint(tmp_path / "a", 5)
    names = [n for n, _ in model.named_parameters()]
    for n, m in zip(names, master):
        assert_close(ck["model"][n], dict(model.named_parameters())[n].detach(), rtol=1e-4, atol=1e-5)
        assert ck["model"][n].dtype == (torch.bfloat16 if bf16 else torch.float32)
        if bf16 or delayed:
            kept = ck["host_master"]["weights"][n]
            assert kept.dtype == torch.float32
            assert_close(kept, m.detach(), rtol=1e-4, atol=1e-5)
    assert ck["host_master"]["pending"] is delayed
    plan = Plan.load(whole.plan_path)
    graph_grads = [s for s in plan.steps if isinstance(s, Copy) and s.dst == "cpu:1"]
    assert graph_grads  # gradients go home over the link ...
    split = dataclasses.replace(config, checkpoint_dir=str(tmp_path / "b"), checkpoint_every=3)
    first = train(dataclasses.replace(split, steps=3))
    second = train(dataclasses.replace(split, steps=5, resume=True))
    assert first.losses + second.losses == whole.losses
    again = read_checkpoint(tmp_path / "b", 5)
    for name, t in ck["model"].items():
        assert torch.equal(t, again["model"][name]), name
    for name, t in ck["host_master"]["weights"].items():
        assert torch.equal(t, again["host_master"]["weights"][name]), name
    for i, st in ck["optimizer"]["state"].items():
        for key, t in st.items():
            assert torch.equal(t, again["optimizer"]["state"][i][key]), (i, key)


def test_bf16_sends_bf16_gradients_home_and_the_breakdown_and_trace_are_reported(mlp, tmp_path, capfd) -> None:
    """Through the CLI with --json and --trace: the weights read and the gradients sent home are bf16 (half the
    link's bytes), each step line has its breakdown (forward and backward runs, lanes by kind, optimizer buckets,
    waits), and the trace has the lanes, the runs and the optimizer's buckets."""
    trace = tmp_path / "step.json"
    args = [f"{mlp}:factory", "--budget", "cpu:0=200KiB", "--budget", "cpu:1=1GiB", "--param-home", "cpu:1"]
    args += ["--store", "cpu:1", "--method", "park", "--profile", "model", "--cache-dir", str(tmp_path / "cache")]
    args += ["--precision", "bf16", "--steps", "2", "--json", "--trace", str(trace)]
    assert main(["train", *args]) == 0
    events = [json.loads(line) for line in capfd.readouterr().out.splitlines()]
    assert events[0]["master_weights"] == "fp32 on the host"
    steps = [e for e in events if e["event"] == "step"]
    for e in steps:
        b = e["breakdown"]
        assert b["forward_s"] > 0 and b["backward_s"] > 0 and b["compute_s"] > 0
        assert b["copy_in_s"] > 0 and b["copy_out_s"] > 0  # weights in, gradients out
        assert b["forward_s"] + b["backward_s"] <= b["wall_s"]
        assert len(b["optimizer_buckets_s"]) >= 2 and b["optimizer_s"] == pytest.approx(sum(b["optimizer_buckets_s"]))
        assert b["optimizer_wait_read_s"] >= 0 and b["optimizer_wait_step_s"] >= 0
    plan = Plan.load(events[0]["plan_path"])
    from xsched.capture.torch import capture  # the plan's graph: its weights and gradients are bf16

    ns: dict = {}
    exec(MLP, ns)
    model, (x, _), _, _ = ns["factory"]()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        graph = capture(model.to(torch.bfloat16), (x,))
    assert graph.fingerprint == plan.graph
    moved = {graph.value[s.value].dtype for s in plan.steps if isinstance(s, Copy)}
    assert moved <= {"bfloat16", "torch.bfloat16"}, moved
    t = json.loads(trace.read_text())
    lanes = {e["args"]["name"] for e in t["traceEvents"] if e["ph"] == "M"}
    assert {"runs", "optimizer"} <= lanes and any(n.startswith("copy:cpu:1->cpu:0") for n in lanes)
    assert any(e["name"].startswith("bucket ") for e in t["traceEvents"] if e["ph"] == "X")


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--delayed-update", "--optimizer", "sgd"], "--delayed-update applies to the host AdamW"),
        (["--delayed-update", "--clip-grad", "1"], "--delayed-update cannot clip"),
        (["--param-home", "cuda:0"], r"--param-home cuda:0 is not among the devices \['cpu:0', 'cpu:1'\]"),
        # one Linear's streamed weight (64 KiB) with its input and output cannot fit 40 KiB: proven, by any method
        (["--budget", "cpu:0=40KiB", "--method", "park"], r"proven.*below the lower bound .* for op op\d+"),
        (["--budget", "cpu:0=40KiB", "--method", "auto"], r"proven infeasible \(budget 40.00 KiB on cpu:0 is below"),
    ],
)
def test_bad_flags_are_one_line_and_exit_2(mlp, tmp_path, capsys, extra, message) -> None:
    args = [f"{mlp}:factory", "--budget", "cpu:0=200KiB", "--budget", "cpu:1=1GiB", "--store", "cpu:1"]
    args += ["--profile", "model", "--cache-dir", str(tmp_path / "cache")]
    if "--param-home" not in extra:
        args += ["--param-home", "cpu:1"]
    assert main(["train", *args, *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and __import__("re").search(message, err[0]), err


def test_the_optimizer_split_homes_the_last_released_parameters_on_the_computing_device(mlp, tmp_path) -> None:
    """--optimizer-split 0.6: the first layers (their gradients come last in the backward, their weights are read
    first) live on cpu:0 with their AdamW, the rest on cpu:1; training equals eager AdamW and resumes bit for bit."""
    config = offloaded(mlp, tmp_path, steps=4, optimizer_split=0.6, checkpoint_dir=str(tmp_path / "a"))
    config = dataclasses.replace(config, budgets={"cpu:0": "1MiB", "cpu:1": "1GiB"})  # 614 KiB: two layers
    whole = train(config)
    plan = Plan.load(whole.plan_path)
    on0 = sorted(v for v, d in plan.homes.items() if v.startswith("param:") and d == "cpu:0")
    on1 = sorted(v for v, d in plan.homes.items() if v.startswith("param:") and d == "cpu:1")
    assert on0 and on1
    assert {"param:0.weight", "param:0.bias", "param:2.weight"} <= set(on0), on0  # the first layers moved
    assert {"param:8.weight", "param:6.weight"} <= set(on1), on1  # the last stayed home
    want, model, _ = eager(4, bf16=False, delayed=False)
    assert_close(whole.losses, want, rtol=1e-5, atol=1e-6)
    ck = read_checkpoint(tmp_path / "a", 4)
    for n, p in model.named_parameters():
        assert_close(ck["model"][n], p.detach(), rtol=1e-4, atol=1e-5)
    split = dataclasses.replace(config, checkpoint_dir=str(tmp_path / "b"), checkpoint_every=2)
    first = train(dataclasses.replace(split, steps=2))
    second = train(dataclasses.replace(split, steps=4, resume=True))
    assert first.losses + second.losses == whole.losses
    for name, t in ck["model"].items():
        assert torch.equal(t, read_checkpoint(tmp_path / "b", 4)["model"][name]), name


def test_gradients_are_copied_home_straight_into_the_optimizers_buffer() -> None:
    """The plan's copy of a gradient home lands in HostAdamW's own buffer (no second host copy), and two steps
    equal torch's fused AdamW on eager gradients."""
    assert_offloaded_mlp_trains_as_fused_adamw()
