"""`xsched train` on one process: losses and weights against plain PyTorch, JSON lines, the plan and profile cache
(reused, and re-made when corrupt), and each user error as one line with exit status 2."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch
from torch.testing import assert_close
from train_support import EXAMPLE, eager_run

from xsched.cli import main
from xsched.contracts.plan import Compute, Plan
from xsched.train import TrainConfig, train
from xsched.train.checkpoint import read_checkpoint, saved_steps

pytestmark = pytest.mark.usefixtures("one_thread")


def test_trains_like_eager_pytorch_and_resumes(tmp_path) -> None:
    """A plan that recomputes (sqrt checkpointing) trains the example MLP with the losses and weights of plain
    PyTorch; a second run resumes from the first one's checkpoint and continues the same curve."""
    ck = tmp_path / "ck"
    config = TrainConfig(
        f"{EXAMPLE}:factory",
        {"cpu": "100%"},
        steps=3,
        batch=32,
        method="sqrt",
        profile="model",
        cache_dir=str(tmp_path / "cache"),
        checkpoint_dir=str(ck),
        checkpoint_every=2,
    )
    first = train(config)
    plan = Plan.load(first.plan_path)
    assert sum(isinstance(s, Compute) for s in plan.steps) > len({s.op for s in plan.steps if isinstance(s, Compute)})
    assert saved_steps(ck) == [3, 2]
    second = train(dataclasses.replace(config, steps=5, resume=True))
    assert second.start_step == 3 and [r.step for r in second.records] == [3, 4]
    want, model = eager_run(EXAMPLE, batch=32, world=1, steps=5)
    assert_close(first.losses + second.losses, want, rtol=1e-5, atol=1e-6)
    state = read_checkpoint(ck, 5)["model"]
    for name, p in model.state_dict().items():
        assert_close(state[name], p, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


def run_json(capfd, *args: str) -> tuple[int, list[dict], str]:
    rc = main(["train", *args, "--json"])
    out, err = capfd.readouterr()
    return rc, [json.loads(line) for line in out.splitlines() if line.strip()], err


def test_json_lines_and_the_plan_and_profile_cache(tmp_path, capfd) -> None:
    """Measured profile and plan are made once, reused by the next run untouched (same losses), and a corrupt
    cache entry is made again with a one-line notice, never a traceback."""
    cache = tmp_path / "cache"
    args = ("zoo:mlp_mixer", "--scale", "tiny", "--budget", "cpu=100%", "--steps", "2", "--cache-dir", str(cache))
    rc, evs, _ = run_json(capfd, *args)
    assert rc == 0
    assert [e["event"] for e in evs] == ["start", "step", "step", "end"]
    start, end = evs[0], evs[-1]
    assert not start["plan_reused"] and start["world"] == 1 and start["devices"] == ["cpu"]
    assert start["energy_source"].startswith(("measured", "modelled"))  # a measured profile carries energy
    assert end["steps_run"] == 2 and end["final_loss"] == evs[2]["loss"]
    plan_file, profile_file = start["plan_path"], start["profile_path"]
    stamps = (os.stat(plan_file).st_mtime_ns, os.stat(profile_file).st_mtime_ns)

    rc, again, err = run_json(capfd, *args)
    assert rc == 0 and again[0]["plan_reused"] and again[0]["plan_path"] == plan_file
    assert (os.stat(plan_file).st_mtime_ns, os.stat(profile_file).st_mtime_ns) == stamps  # neither re-made
    assert [e["loss"] for e in again if e["event"] == "step"] == [e["loss"] for e in evs if e["event"] == "step"]

    with open(plan_file, "w") as f:
        f.write('{"schema": "xsched.plan/1", "steps": [')
    rc, third, err = run_json(capfd, *args)
    assert rc == 0 and not third[0]["plan_reused"]
    notices = [line for line in err.splitlines() if "plan cache" in line]
    assert len(notices) == 1 and "planning again" in notices[0] and "Traceback" not in err
    assert third[0]["plan_path"] == plan_file and Plan.load(plan_file).extra["train_cache_key"] in plan_file

    stale = json.loads(open(plan_file).read()) | {"train_cache_key": "0" * 16}  # a whole plan, for another key
    with open(plan_file, "w") as f:
        json.dump(stale, f)
    rc, _, err = run_json(capfd, *args)
    assert rc == 0 and "made for another graph, profile, devices or budgets; planning again" in err
    assert Plan.load(plan_file).extra["train_cache_key"] != "0" * 16

    with open(profile_file, "w") as f:
        f.write("not json")
    rc, fourth, err = run_json(capfd, *args)
    assert rc == 0 and "Traceback" not in err
    assert os.stat(profile_file).st_mtime_ns != stamps[1]
    json.loads(open(profile_file).read())  # measured again and stored whole

    rc, gapped, _ = run_json(capfd, *args, "--gap", "0.05")  # another gap, another plan (the profile reused)
    assert rc == 0 and not gapped[0]["plan_reused"] and gapped[0]["plan_path"] != plan_file
    assert gapped[0]["profile_path"] == profile_file and Plan.load(gapped[0]["plan_path"]).solver.gap <= 0.05


FACTORIES = """
import torch
from torch import nn

def model_and_inputs(batch=4):  # a capture factory, not a training one
    return nn.Linear(8, 2), (torch.randn(batch, 8),)

def bare_tensor(batch=4):
    return nn.Linear(8, 2), torch.randn(batch, 8), nn.functional.mse_loss

def not_a_model(batch=4):
    return "linear", (torch.randn(batch, 8), torch.randn(batch, 2)), nn.functional.mse_loss

def vector_loss(batch=4):
    torch.manual_seed(0)
    return (nn.Linear(8, 2), (torch.randn(batch, 8), torch.randn(batch, 2)),
            lambda out, y: (out - y).pow(2).sum(1))
"""


@pytest.mark.parametrize(
    "args,message",
    [
        (["nonsense", "--budget", "cpu=1GiB"], "MODEL must be zoo:NAME, hf:TYPE or file.py:factory"),
        (["zoo:nope", "--budget", "cpu=1GiB"], "unknown model 'nope'"),
        (["zoo:gpt2", "--budget", "cpu=lots"], "cannot parse budget 'lots'"),
        (["zoo:gpt2", "--budget", "cpu"], "--budget wants DEVICE=SIZE"),
        (["zoo:gpt2"], "give at least one budget"),
        (["zoo:gpt2", "--budget", "cpu=1GiB", "--steps", "0"], "--steps must be at least 1"),
        (["zoo:gpt2", "--budget", "cpu=1GiB", "--gap", "1.5"], "--gap must be a relative gap in [0, 1), got 1.5"),
        (["zoo:gpt2", "--budget", "cpu=1GiB", "--resume"], "--resume needs --checkpoint-dir"),
        (["zoo:gpt2", "--budget", "cpu=1GiB", "--resume", "--checkpoint-dir", "{tmp}/none"], "does not exist"),
        (["zoo:gpt2", "--budget", "cpu=1GiB", "--resume", "--checkpoint-dir", "{tmp}"], "no checkpoint"),
        (["{tmp}/m.py:model_and_inputs", "--budget", "cpu=1GiB"], "returned a tuple of length 2; a training"),
        (["{tmp}/m.py:bare_tensor", "--budget", "cpu=1GiB"], "example_batch must be (inputs, targets), got a Tensor"),
        (["{tmp}/m.py:not_a_model", "--budget", "cpu=1GiB"], "the model must be an nn.Module, got str"),
        (["{tmp}/m.py:missing", "--budget", "cpu=1GiB"], "has no function 'missing'"),
        (
            ["{tmp}/m.py:vector_loss", "--budget", "cpu=100%", "--profile", "model"],
            "loss_fn returned a tensor of shape [4]",
        ),
        (["{tmp}/m.py:vector_loss", "--budget", "cpu=64", "--profile", "model"], "proven infeasible"),
    ],
    ids=[
        "spec",
        "zoo-name",
        "budget",
        "budget-flag",
        "no-budget",
        "steps",
        "gap",
        "resume-no-dir",
        "resume-missing-dir",
        "resume-empty-dir",
        "capture-factory",
        "bare-tensor",
        "not-a-model",
        "no-function",
        "vector-loss",
        "infeasible",
    ],
)
def test_user_errors_are_one_line_and_exit_2(tmp_path, capsys, args, message) -> None:
    (tmp_path / "m.py").write_text(FACTORIES)
    argv = ["train", *(a.replace("{tmp}", str(tmp_path)) for a in args), "--cache-dir", str(tmp_path / "cache")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("xsched: error:")]
    assert len(errors) == 1 and message in errors[0], err
    assert "Traceback" not in err and err.rstrip().endswith(errors[0])  # the error is the last word, one line


def test_a_finished_run_resumed_trains_nothing(tmp_path) -> None:
    ck = tmp_path / "ck"
    config = TrainConfig(
        "zoo:gpt2",
        {"cpu": "100%"},
        steps=2,
        scale="tiny",
        profile="model",
        cache_dir=str(tmp_path / "cache"),
        checkpoint_dir=str(ck),
    )
    train(config)
    again = train(dataclasses.replace(config, resume=True))
    assert again.start_step == 2 and again.records == ()
    assert torch.load(ck / "step-00000002.pt", weights_only=True)["data"] == {"next_step": 2, "world": 1}


@pytest.mark.gpu
def test_trains_on_a_gpu_like_eager_pytorch(tmp_path) -> None:
    """A bare `cuda` budget is this process's GPU: the example MLP trains there (measured profile, auto plan) with
    plain PyTorch's losses, and its peak memory is measured, not predicted."""
    config = TrainConfig(
        f"{EXAMPLE}:factory", {"cuda": "100%", "cpu": "100%"}, steps=3, batch=32, cache_dir=str(tmp_path / "cache")
    )
    result = train(config)
    want, _ = eager_run(EXAMPLE, batch=32, world=1, steps=3)
    assert_close(result.losses, want, rtol=1e-4, atol=1e-5)
    assert set(Plan.load(result.plan_path).homes.values()) == {"cuda:0"}  # params and inputs on the first device
    assert result.records[-1].peak_source["cuda:0"] == "measured" and result.records[-1].peak_bytes["cuda:0"] > 0


def test_an_unreadable_newest_checkpoint_falls_back_to_the_one_before(tmp_path) -> None:
    """Atomic saves leave whole files, but a disk can still lose one: resume takes the newest that reads, with a
    one-line notice, and ignores the temp file of a save that was killed."""
    from xsched.train.checkpoint import newest_checkpoint, save_checkpoint

    for step in (2, 4, 6):
        save_checkpoint(tmp_path, step, {"step": step, "model": {"w": torch.full((3,), float(step))}})
    assert saved_steps(tmp_path) == [6, 4]  # the newest two are kept
    (tmp_path / ".step-00000008.pt.x1y2.tmp").write_bytes(b"half a checkpoint")
    (tmp_path / "step-00000006.pt").write_bytes((tmp_path / "step-00000006.pt").read_bytes()[:100])
    notices: list[str] = []
    step, state = newest_checkpoint(tmp_path, notices.append)
    assert step == 4 and state["model"]["w"].tolist() == [4.0] * 3
    assert len(notices) == 1 and "step-00000006.pt" in notices[0] and "\n" not in notices[0]
