"""Executor(issue="one"): the calling thread issues an overlapped slice's tasks in plan order onto their lanes'
streams (a fake CUDA on logical CPUs, tests/lane_cost_support.py). Its results equal eager PyTorch's, every step is
ordered on its stream after the steps the overlap model makes it wait for (the streams' vector clocks, which see a
dropped wait), no lane thread starts, no host blocks on the device; a slice with a host lane runs on lanes; a bad
mode is one line; `xsched train --issue one` reaches the executor and trains as eager."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
from executor_support import TWO, recompute_plan, workload
from lane_cost_support import FakeEvent, fake_cuda
from test_lane_cost import run_on_fake_cuda
from test_param_offload_modes import MLP, eager, offloaded
from torch.testing import assert_close
from train_support import ROOT, assert_offloaded_mlp_trains_as_fused_adamw, child_env

from xsched.errors import XschedError
from xsched.execute import workers
from xsched.execute.executor import Executor
from xsched.train import train


def run_gpt2(monkeypatch: pytest.MonkeyPatch, issue: str, fake: bool = True, clock: bool = False) -> tuple:
    """test_lane_cost's run of gpt2's two-device plan against eager, issued as `issue` says."""
    ex, positions, _ = run_on_fake_cuda(monkeypatch, clock, issue, fake)
    return ex, positions


@pytest.mark.parametrize("clock", [False, True])
def test_one_thread_issues_every_step_in_order_on_its_stream(monkeypatch: pytest.MonkeyPatch, clock: bool) -> None:
    ex, positions = run_gpt2(monkeypatch, "one", clock=clock)
    assert ex.started == []  # no lane thread: the calling thread issued every task
    assert positions.unordered(ex) == []
    assert len(positions.at) == sum(not k.startswith("free:") for k in ex.lane_of)  # every CUDA step seen
    counts = FakeEvent.counts
    assert counts["synchronize"] == 0 and counts["own_wait"] == 0 and counts["repeated_wait"] == 0
    assert counts["wait_event"] > 0  # the copies and computes wait for each other on the device
    _, tasks = ex.lane_runner.lane_tasks(0, len(ex.plan.steps))
    cuda_tasks = sum(lane.kind == "cuda" for *_, lane, _, _ in tasks)
    assert counts["record"] == 2 * cuda_tasks * (2 if clock else 1)  # as on lanes: an event a task (two timed)
    by_stream: dict[str, list[int]] = {}
    for i in sorted(positions.at):  # each stream takes its steps in plan order
        by_stream.setdefault(positions.at[i][0], []).append(positions.at[i][1])
    assert len(by_stream) >= 3 and all(p == sorted(p) for p in by_stream.values())  # compute and both copies


def test_the_order_check_sees_a_dropped_wait_in_one_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    wait = workers.Lane.wait

    def forgetful(self: workers.Lane, dep: workers.Done) -> None:
        if self.name.startswith("compute:") and any(k.startswith("copy:") for k in dep.cuda):
            return  # the stream does not wait for the copy
        wait(self, dep)

    monkeypatch.setattr(workers.Lane, "wait", forgetful)
    ex, positions = run_gpt2(monkeypatch, "one")
    assert positions.unordered(ex), "a compute reading a copied value must be seen unordered after its copy"


def test_a_slice_with_host_lanes_runs_on_lanes_and_a_bad_mode_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    ex, _ = run_gpt2(monkeypatch, "one", fake=False)  # logical CPUs: host lanes, which would block one issuer
    assert ex.started, "host lanes run on their threads"
    z, graph = workload("gpt2")
    with pytest.raises(XschedError, match=r"issue must be one of lanes, one, not 'two'"):
        Executor(graph, recompute_plan("gpt2", TWO, 50), issue="two")


def test_train_issue_one_reaches_the_executor_and_trains_as_eager(tmp_path, monkeypatch) -> None:
    path = tmp_path / "mlp.py"
    path.write_text(MLP)
    seen = []
    init = Executor.__init__

    def noting(self, *args, **kwargs) -> None:
        init(self, *args, **kwargs)
        seen.append(self.issue)

    monkeypatch.setattr(Executor, "__init__", noting)
    config = offloaded(path, tmp_path, steps=3, issue="one")
    got = train(config)
    want, _, _ = eager(3, bf16=False, delayed=False)
    assert_close(got.losses, want, rtol=1e-5, atol=1e-6)
    assert seen and set(seen) == {"one"}
    with pytest.raises(XschedError, match="--issue must be lanes or one, got 'both'"):
        dataclasses.replace(config, issue="both").check()


def test_the_issue_bench_runs_both_ways_as_eager(tmp_path) -> None:
    cmd = [sys.executable, str(ROOT / "scripts" / "bench_issue.py"), "--layers", "2", "--steps", "4", "--warmup", "1"]
    p = subprocess.run(
        [*cmd, "--cache-dir", str(tmp_path)], capture_output=True, text=True, env=child_env(), timeout=300
    )
    assert p.returncode == 0, p.stderr[-3000:]
    rows = [line for line in p.stdout.splitlines() if line.startswith(("| lanes (", "| one ("))]
    assert len(rows) == 2 and all(row.endswith("| yes |") for row in rows), rows


def test_the_offload_bench_rows_of_the_issuer_and_the_share_train_as_the_xsched_row(tmp_path, monkeypatch) -> None:
    """`bench_gpu_param_offload.py`'s xsched_one and xsched_allcores rows (run in this process, its reduced mode at
    a tiny size): the same losses as its xsched row, and each says how it ran."""
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    import bench_param_offload_rows as rows
    from bench_gpu_param_offload import CPU

    scale = "small:n_layer=2,n_embd=128,n_head=2,seq=16"
    setup = {**CPU, "cpu": True, "steps": 2, "time_limit": 30.0, "profile": "model", "scale": scale}
    setup["cache_dir"] = str(tmp_path)
    base = rows.row_xsched(setup)
    one, allcores = rows.row_xsched_one(setup), rows.row_xsched_allcores(setup)
    assert one["losses"] == base["losses"] == allcores["losses"]  # the same arithmetic, the same plan (cached)
    assert one["note"].startswith("--issue one, run on lanes: its lanes are host lanes; host AdamW: ")  # on cpu:0
    assert allcores["note"].startswith("host AdamW: ") and "nice as it is; plan offload at 3MiB" in allcores["note"]


def test_a_wrapped_model_issued_by_one_thread_beside_the_host_adamw_trains_as_torch(monkeypatch) -> None:
    """wrap's forward and backward slices, on fake CUDA lanes issued by the calling thread, each gradient copied home
    into HostAdamW's buffer: two steps equal torch's fused AdamW on eager gradients, and no lane thread started."""

    def one_thread_on_fake_cuda(w) -> None:
        ex = w._first.executor
        ex.overlap, ex.issue = True, "one"
        fake_cuda(ex, monkeypatch)

    w = assert_offloaded_mlp_trains_as_fused_adamw(one_thread_on_fake_cuda)
    assert all(lane._thread is None for lane in w._first.executor.lanes.values())
    assert FakeEvent.counts["record"] > 0 and FakeEvent.counts["synchronize"] == 0
