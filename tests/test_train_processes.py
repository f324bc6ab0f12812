"""`xsched train` as real processes: a run killed with SIGKILL resumes from its checkpoint on the same loss curve,
and torchrun's two ranks (gloo) train like plain PyTorch on the combined batch, and all resume."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
from torch.testing import assert_close
from train_support import EXAMPLE, child_env, cli, eager_run, events, free_port, step_losses

from xsched.train import TrainConfig, train
from xsched.train.checkpoint import read_checkpoint, saved_steps

pytestmark = pytest.mark.usefixtures("one_thread")

GPT = ("zoo:gpt2", "--scale", "tiny", "--budget", "cpu=100%", "--profile", "model", "--seed", "3")  # dropout 0.1


def test_killed_run_resumes_on_the_same_curve(tmp_path) -> None:
    """SIGKILL mid-run (it was asked for 10^6 steps): at most K steps are lost, and the resumed run repeats the
    killed run's later steps bit for bit and follows an uninterrupted run (dropout included: RNG restored)."""
    ck, every = tmp_path / "ck", 3
    args = (*GPT, "--checkpoint-dir", str(ck), "--checkpoint-every", str(every), "--json")
    with open(tmp_path / "err", "w") as err:
        proc = subprocess.Popen(
            cli(*args, "--steps", "1000000"),
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            env=child_env(),
            cwd=tmp_path,
            start_new_session=True,
        )
        seen = []
        for line in proc.stdout:  # type: ignore[union-attr]
            seen.append(json.loads(line))
            if seen[-1]["event"] == "step" and seen[-1]["step"] >= 7:
                os.kill(proc.pid, signal.SIGKILL)
                break
        rest = proc.stdout.read()  # type: ignore[union-attr]
        assert proc.wait(timeout=60) == -signal.SIGKILL
    seen += [json.loads(x) for x in rest.splitlines() if x.endswith("}")]  # the last line may be cut off
    killed = step_losses(seen)
    last = max(killed)
    saved = saved_steps(ck)[0]
    assert last + 1 - saved <= every, f"{last + 1} steps done, newest checkpoint after {saved}"

    resumed = subprocess.run(
        cli(*args, "--resume", "--steps", str(saved + 4)),
        capture_output=True,
        text=True,
        env=child_env(),
        cwd=tmp_path,
        timeout=300,
    )
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    evs = events(resumed.stdout)
    assert evs[0]["start_step"] == saved and evs[0]["plan_reused"]
    after = step_losses(evs)
    assert sorted(after) == list(range(saved, saved + 4))
    for step in set(after) & set(killed):
        assert after[step] == killed[step], f"step {step}: resumed {after[step]!r}, killed run {killed[step]!r}"

    whole = train(
        TrainConfig(
            "zoo:gpt2",
            {"cpu": "100%"},
            steps=saved + 4,
            scale="tiny",
            profile="model",
            seed=3,
            cache_dir=str(tmp_path / "fresh"),
        )
    )
    curve = [killed[s] for s in range(saved)] + [after[s] for s in range(saved, saved + 4)]
    assert_close(curve, whole.losses, rtol=1e-6, atol=1e-6)


def torchrun(tmp_path, *args: str) -> list[dict]:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-port",
        str(free_port()),
        *cli(*args, "--json")[1:],
    ]
    run = subprocess.run(cmd, capture_output=True, text=True, env=child_env(), cwd=tmp_path, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    evs = events(run.stdout)  # every line JSON: only rank 0 prints, and only JSON
    assert [e["event"] for e in evs].count("start") == 1 and evs[0]["world"] == 2
    return evs


@pytest.mark.parametrize("batch,accum", [(16, 1), (8, 2)], ids=["batch16", "batch8x2"])
def test_torchrun_two_ranks_train_like_eager_on_the_combined_batch(tmp_path, batch, accum) -> None:
    """Two ranks of batch 16, or of two accumulated micro-batches of 8 (DDP all-reduces on the second only), give
    the losses and final weights of one plain PyTorch model on 32 rows a step."""
    ck = tmp_path / "ck"
    evs = torchrun(
        tmp_path,
        f"{EXAMPLE}:factory",
        "--batch",
        str(batch),
        "--grad-accum",
        str(accum),
        "--budget",
        "cpu=100%",
        "--steps",
        "4",
        "--profile",
        "model",
        "--checkpoint-dir",
        str(ck),
    )
    want, model = eager_run(EXAMPLE, batch=16, world=2, steps=4)
    got = step_losses(evs)
    assert_close([got[s] for s in range(4)], want, rtol=1e-5, atol=1e-6)
    assert saved_steps(ck) == [4]  # rank 0 alone wrote it, at the end
    state = read_checkpoint(ck, 4)
    assert len(state["rng"]) == 2 and state["data"] == {"next_step": 4, "world": 2}
    for name, p in model.state_dict().items():  # Adam divides by sqrt(v): a float-rounding grad difference near
        # zero moves a weight by a visible part of one lr-sized step, hence atol 1e-5 (lr 1e-3)
        assert_close(state["model"][name], p, rtol=1e-5, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


def test_torchrun_ranks_all_resume(tmp_path) -> None:
    """GPT-2 with dropout on two ranks: resuming from step 2 repeats steps 2 and 3 of the uninterrupted run bit for
    bit, which needs every rank's model, optimizer state and RNG streams back."""
    ck = tmp_path / "ck"
    args = (*GPT, "--checkpoint-dir", str(ck), "--checkpoint-every", "2", "--steps", "4")
    whole = step_losses(torchrun(tmp_path, *args))
    assert saved_steps(ck) == [4, 2]
    (ck / "step-00000004.pt").unlink()
    evs = torchrun(tmp_path, *args, "--resume")
    assert evs[0]["start_step"] == 2 and evs[0]["plan_reused"]
    assert step_losses(evs) == {2: whole[2], 3: whole[3]}
