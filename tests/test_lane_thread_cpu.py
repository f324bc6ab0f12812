"""The step clock's CPU beside wall per lane kind (issue 30): each task's thread CPU (the lane's own, or the caller's
inline) is read around it, so wall - CPU is what the lane waited for (the GIL, a lock, a blocking call). Checked by
counts (tasks a step per kind, against the lanes run's own task list; the scheduler's context switches of the
threads that ran them), by attribution (a task that waits on another
thread's work has its wall, not that thread's CPU), on logical CPUs against eager PyTorch; and the benchmarks' new
options refuse bad values with one line."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest
import torch
from executor_support import TWO, eager_reference, recompute_plan, workload
from torch.testing import assert_close
from train_support import ROOT, child_env

from xsched.capture.torch import bind_inputs, unpack_outputs
from xsched.execute.executor import Executor
from xsched.execute.step_clock import KINDS, StepClock, lane_kinds, thread_counters

pytestmark = pytest.mark.usefixtures("one_thread")

SLACK_S = 2e-3  # a clock read's granularity per task, generous: CPU within its wall is an invariant, not a timing


def spin(seconds: float) -> None:
    """Burn this thread's CPU for `seconds` of its own CPU time."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


@pytest.mark.parametrize("overlap", [True, False])
def test_each_kind_has_its_tasks_cpu_within_their_wall(overlap: bool) -> None:
    """gpt2's two-device plan (copies both ways, frees) on lanes and inline, twice: per kind the breakdown counts the
    tasks the run timed (on lanes: exactly the lanes run's task list by kind), their CPU within their wall, the
    compute lane's CPU above zero; the outputs and gradients are eager's."""
    z, graph = workload("gpt2")
    plan = recompute_plan("gpt2", TWO, 50)
    ex = Executor(graph, plan, overlap=overlap)
    ex.clock = clock = StepClock()
    clock.kind_of = lane_kinds(ex.lane_of, {"cpu:0"})  # cpu:1 parks: copies to it are out
    env = bind_inputs(graph, z.model, z.inputs)
    outs, grads, _ = eager_reference("gpt2", seed=7)
    try:
        for _ in range(2):
            torch.manual_seed(7)
            clock.start()
            got = unpack_outputs(graph, ex(env).outputs)
            b = clock.read()
            for a, e in zip(got.outputs, outs, strict=True):
                assert_close(a, e.detach(), rtol=1e-5, atol=1e-6)
            for n, g in got.grads.items():
                assert_close(g, grads[n], rtol=1e-5, atol=1e-6)
            timed = {k: sum(1 for lane, *_ in clock.last.host if clock.kind_of.get(lane) == k) for k in KINDS}
            for kind in KINDS:
                assert b[f"{kind}_tasks"] == float(timed[kind])
                assert 0.0 <= b[f"{kind}_issue_cpu_s"] <= b[f"{kind}_issue_s"] + SLACK_S * timed[kind], (kind, b)
            assert b["compute_tasks"] > 0 and b["copy_in_tasks"] > 0 and b["copy_out_tasks"] > 0
            assert b["compute_issue_cpu_s"] > 0.0
            assert all(cpu is not None and tid is not None for *_, cpu, tid in clock.last.host)  # every task's CPU
            if thread_counters(threading.get_native_id()) is not None:  # the threads that ran each kind (Linux)
                for kind in KINDS:
                    assert 0 <= b[f"{kind}_preempted"] <= b[f"{kind}_switches"] and b[f"{kind}_ready_s"] >= 0
            if overlap:
                _, tasks = ex.lane_runner.lane_tasks(0, len(plan.steps))
                want = {k: sum(clock.kind_of[lane.name] == k for _, _, lane, _, _ in tasks) for k in KINDS}
                assert {k: b[f"{k}_tasks"] for k in KINDS} == {k: float(n) for k, n in want.items()}
    finally:
        ex.close()


def test_the_cpu_is_the_running_threads_own() -> None:
    """A task that waits while another thread burns 30 ms of CPU has that wait in its wall, not in its CPU; a task
    that burns its own has it in its CPU (the thread's clock, not the process's)."""
    clock = StepClock()
    clock.kind_of = {"compute:cpu:0": "compute", "copy:cpu:1->cpu:0": "copy_in"}

    def wait_for_other(_: object) -> None:
        t = threading.Thread(target=spin, args=(0.03,))
        t.start()
        t.join()

    clock.start()
    clock.timed("compute:cpu:0", "steps 0-0", wait_for_other)(None)
    clock.timed("copy:cpu:1->cpu:0", "steps 1-1", lambda _: spin(0.03))(None)
    b = clock.read()
    assert b["compute_issue_s"] >= 0.03 and b["compute_issue_cpu_s"] < 0.5 * b["compute_issue_s"]
    assert b["copy_in_issue_cpu_s"] >= 0.03 - SLACK_S
    assert (b["compute_tasks"], b["copy_in_tasks"], b["copy_out_tasks"]) == (1.0, 1.0, 0.0)
    if thread_counters(threading.get_native_id()) is not None:  # Linux: the scheduler's counts of the task's thread
        assert b["compute_switches"] >= 1  # the join slept: a voluntary switch at least
        assert 0 <= b["compute_preempted"] <= b["compute_switches"] and b["compute_ready_s"] >= 0
        assert b["copy_out_switches"] == 0.0  # no task, no thread


def test_spans_without_cpu_and_the_trace() -> None:
    """A span reported without its CPU (the optimizer's buckets) counts none; the trace carries each timed task's
    thread CPU in its arguments, and none for a span that has none."""
    clock = StepClock()
    clock.kind_of = {"compute:cpu:0": "compute"}
    clock.start()
    clock.timed("compute:cpu:0", "steps 0-3", lambda _: spin(0.002))(None)
    t = time.perf_counter()
    clock.span("compute:cpu:0", "steps 4-4", t, t + 0.001)
    clock.span("optimizer", "bucket 0", t, t + 0.001)
    b = clock.read()
    assert b["compute_tasks"] == 2.0 and b["compute_issue_cpu_s"] >= 0.002 - SLACK_S
    args = {e["name"]: e["args"] for e in clock.trace()["traceEvents"] if e["ph"] == "X"}
    assert args["steps 0-3"]["thread CPU (ms)"] >= 2.0 - SLACK_S * 1e3
    assert args["steps 4-4"] == {} and args["bucket 0"] == {}


def test_updates_that_end_past_the_steps_close_join_its_trace_once_settled() -> None:
    """The host AdamW's bucket updates run past the step's close (the last step's always do): `xsched train
    --trace` wrote the last step without them whenever none ended inside it (a flaky test in CI). Once the loop
    has settled, the optimizer's late spans join the closed step; other lanes' do not."""
    clock = StepClock()
    clock.start()
    t = time.perf_counter()
    clock.span("optimizer", "grads 0", t, t + 0.001)
    clock.read()
    clock.span("optimizer", "bucket 0", t + 0.002, t + 0.003)  # past the close
    clock.span("compute:cpu:0", "steps 0-3", t + 0.002, t + 0.003)
    names = lambda: [e["name"] for e in clock.trace()["traceEvents"] if e["ph"] == "X"]  # noqa: E731
    assert names() == ["grads 0"]
    clock.settled()
    assert names() == ["grads 0", "bucket 0"]


@pytest.mark.parametrize(
    "script, args, says",
    [
        ("bench_host_overhead.py", ["--switch-intervals", "0.001,-1"], "--switch-intervals must be positive"),
        ("bench_host_overhead.py", ["--switch-intervals", "fast"], "--switch-intervals must be positive"),
        ("bench_gpu_param_offload.py", ["--cpu", "--switch-interval", "0"], "--switch-interval must be positive"),
    ],
)
def test_bad_switch_intervals_get_one_line(script: str, args: list[str], says: str) -> None:
    p = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / script), *args],
        capture_output=True,
        text=True,
        env=child_env(),
        timeout=120,
    )
    assert p.returncode == 2 and says in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr
