"""The host optimizer's share of the host (train.host_share): beside a GPU its worker takes the cores the issuing
threads leave, at a raised nice value, read back from the OS; the worker keeps its thread count while the process's
default goes back; training with a share equals the eager reference; bad values are one line and exit 2."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
import threading

import pytest
import torch
from test_param_offload_modes import MLP, eager, offloaded
from torch.testing import assert_close
from train_support import ROOT, child_env

from xsched.cli import main
from xsched.errors import XschedError
from xsched.train import host_share, train
from xsched.train.host_share import HOST_NICE, HostShare, default_share, start_shared


def own_nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


@pytest.fixture
def mlp(tmp_path):
    path = tmp_path / "mlp.py"
    path.write_text(MLP)
    return path


def test_beside_a_gpu_the_worker_leaves_the_issuing_threads_their_cores(monkeypatch) -> None:
    monkeypatch.setattr(host_share, "available_cores", lambda: 16)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 16)
    assert default_share(4, beside_gpu=True) == HostShare(12, HOST_NICE)
    assert default_share(20, beside_gpu=True) == HostShare(1, HOST_NICE)  # at least one thread
    monkeypatch.setattr(torch, "get_num_threads", lambda: 8)  # torch's count (physical cores) bounds it
    assert default_share(4, beside_gpu=True) == HostShare(8, HOST_NICE)
    assert default_share(4, beside_gpu=False) == HostShare()  # logical CPUs: as any thread


@pytest.mark.skipif(not hasattr(os, "getpriority"), reason="needs a thread's nice value")
def test_the_worker_keeps_its_share_and_the_process_default_goes_back() -> None:
    before = torch.get_num_threads()
    go, seen = threading.Event(), {}

    def target() -> None:
        go.wait()  # after start_shared returned: the default is back by now
        torch.ones(1 << 20).mul_(2)  # its first parallel op: torch would set a thread's count here if not yet set
        seen["threads"], seen["nice"] = torch.get_num_threads(), own_nice()

    want_threads = 1 if before > 1 else 2
    thread, note = start_shared(target, "probe", HostShare(want_threads, 3))
    fresh = {}
    other = threading.Thread(target=lambda: fresh.setdefault("threads", torch.get_num_threads()))
    other.start()
    other.join()
    go.set()
    thread.join()
    assert torch.get_num_threads() == before and fresh["threads"] == before
    assert seen["threads"] == want_threads
    if sys.platform.startswith("linux"):
        assert seen["nice"] == min(19, own_nice() + 3)
        assert note == f"{want_threads} thread(s), nice {seen['nice']:+d}"


def test_a_share_that_cannot_be_taken_is_one_line() -> None:
    with pytest.raises(XschedError, match="at least one thread, got 0"):
        HostShare(0)
    with pytest.raises(XschedError, match="nice increment must be at least 0"):
        HostShare(None, -1)


class Watch:
    """A train reporter that keeps the start info and, at each step, the host optimizer worker's nice value."""

    def __init__(self) -> None:
        self.info: dict = {}
        self.nice: list[int] = []

    def start(self, info) -> None:
        self.info = info

    def step(self, record) -> None:
        worker = next(t for t in threading.enumerate() if t.name == "xsched-host-adamw")
        self.nice.append(os.getpriority(os.PRIO_PROCESS, worker.native_id))

    def checkpoint(self, step, path) -> None: ...
    def notice(self, text) -> None: ...
    def end(self, result) -> None: ...
    def close(self) -> None: ...


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a thread's own nice value is Linux's")
def test_training_with_a_share_equals_eager_and_the_os_shows_it(mlp, tmp_path) -> None:
    watch = Watch()
    config = offloaded(mlp, tmp_path, steps=4, host_threads=1, host_nice=4)
    got = train(config, watch)
    want, _, _ = eager(4, bf16=False, delayed=False)
    assert_close(got.losses, want, rtol=1e-5, atol=1e-6)
    assert watch.nice == [min(19, own_nice() + 4)] * 4
    assert watch.info["host_share"] == f"1 thread(s), nice {watch.nice[0]:+d}"
    plain = Watch()
    train(dataclasses.replace(config, host_threads=None, host_nice=None), plain)  # logical CPUs: as it is
    assert plain.nice == [own_nice()] * 4 and plain.info["host_share"].endswith("nice as it is")


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--host-threads", "0"], r"--host-threads must be a thread count of at least 1 or all, got 0"),
        (["--host-threads", "many"], r"--host-threads must be .* got 'many'"),
        (["--host-nice", "20"], r"--host-nice must be an increment from 0 to 19"),
        (["--host-nice", "-1"], r"--host-nice must be an increment from 0 to 19"),
        (["--host-threads", "2", "--no-home"], r"--host-threads needs --param-home"),
    ],
)
def test_bad_share_flags_are_one_line_and_exit_2(mlp, tmp_path, capsys, extra, message) -> None:
    args = [f"{mlp}:factory", "--budget", "cpu:0=320KiB", "--budget", "cpu:1=1GiB", "--store", "cpu:1"]
    args += ["--profile", "model", "--cache-dir", str(tmp_path / "cache")]
    if "--no-home" in extra:
        extra = [x for x in extra if x != "--no-home"]
    else:
        args += ["--param-home", "cpu:1"]
    assert main(["train", *args, *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and re.search(message, err[0]), err


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a thread's own nice value is Linux's")
def test_the_share_bench_runs_every_share_with_the_same_losses(tmp_path) -> None:
    cmd = [sys.executable, str(ROOT / "scripts" / "bench_host_share.py"), "--layers", "2", "--embd", "64"]
    cmd += ["--budget", "1MiB", "--rounds", "1", "--block", "3", "--shares", "2:0,1:5", "--cache-dir", str(tmp_path)]
    p = subprocess.run(cmd, capture_output=True, text=True, env=child_env(), timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = [line for line in p.stdout.splitlines() if line.startswith("| 2:0 ") or line.startswith("| 1:5 ")]
    assert len(rows) == 2 and all(row.endswith("| yes |") for row in rows), rows
    assert "| 2 thread(s), nice as it is |" in rows[0] and re.search(r"\| 1 thread\(s\), nice \+\d+ \|", rows[1])


def test_the_issuing_threads_are_the_training_thread_and_the_lanes_that_issue() -> None:
    from types import SimpleNamespace

    from xsched.train.session import issuing_threads

    lanes = dict.fromkeys(["compute:cuda:0", "copy:cpu->cuda:0", "copy:cuda:0->cpu", "free:cuda:0", "free:cpu"])
    ex = SimpleNamespace(lanes=lanes, overlap=True, issue="lanes")
    wrapped = SimpleNamespace(_first=SimpleNamespace(executor=ex))
    assert issuing_threads(wrapped) == 4  # the training thread, the compute lane and two copy lanes
    ex.issue = "one"
    assert issuing_threads(wrapped) == 1
    ex.issue, ex.overlap = "lanes", False  # inline, in plan order (logical CPUs)
    assert issuing_threads(wrapped) == 1


def test_a_share_the_worker_cannot_take_is_one_line_and_its_target_never_runs(monkeypatch) -> None:
    def refuse(share: HostShare) -> str:
        raise OSError("setpriority: operation not permitted")

    monkeypatch.setattr(host_share, "take_share", refuse)
    ran = []
    with pytest.raises(XschedError, match="could not take its share: setpriority: operation not permitted"):
        start_shared(lambda: ran.append(1), "probe", HostShare(1, 3))
    assert ran == []


def test_share_flags_where_the_optimizer_cannot_overlap_are_said_unused(mlp, tmp_path, capsys) -> None:
    train(offloaded(mlp, tmp_path, steps=1, clip_grad=0.5, host_threads=1))
    err = capsys.readouterr().err
    assert (
        "not overlapped: --clip-grad" in err and "--host-threads and --host-nice size the overlapped one: unused" in err
    )
