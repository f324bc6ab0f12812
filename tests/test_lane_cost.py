"""What the lanes cost per task on the CUDA path, counted on logical CPUs with a fake CUDA
(tests/lane_cost_support.py): a task records one CUDA event (two with the step clock, whose end event marks it done),
no lane waits for its own stream's events or again for an event at or before one it waited for, every step is still
ordered on its stream after the steps the overlap model makes it wait for, and the results equal eager PyTorch's;
and each compute-lane task is one generated program with the step functions' numbers."""

from __future__ import annotations

import pytest
import torch
from executor_support import TWO, eager_reference, recompute_plan, workload
from lane_cost_support import FakeEvent, Positions, fake_cuda
from torch.testing import assert_close

from xsched.capture.torch import bind_inputs, unpack_outputs
from xsched.contracts.plan import Compute
from xsched.execute.executor import Executor
from xsched.execute.step_clock import StepClock, lane_kinds
from xsched.execute.steps import prepare_compute
from xsched.execute.workers import Done, Lane
from xsched.simulate import simulate


def run_on_fake_cuda(
    monkeypatch: pytest.MonkeyPatch, clock: bool, issue: str = "lanes", fake: bool = True
) -> tuple[Executor, Positions, int]:
    """gpt2's two-device plan (copies both ways, frees on their own lanes) run twice on lanes over fake streams
    (`fake`; else on the logical CPUs' host lanes), issued as `issue` says, checked against eager; the executor (its
    `started`: the lane threads that ran), where its steps ran, and its tasks a run on CUDA lanes."""
    z, graph = workload("gpt2")
    plan = recompute_plan("gpt2", TWO, 50)
    positions = Positions()  # it reads the current fake stream, which fake_cuda's stream context sets
    ex = Executor(graph, plan, table=positions.table(), overlap=True, issue=issue)
    if fake:
        fake_cuda(ex, monkeypatch)
    if clock:
        ex.clock = StepClock()
        ex.clock.kind_of = lane_kinds(ex.lane_of, set(TWO))
    env = bind_inputs(graph, z.model, z.inputs)
    outs, grads, _ = eager_reference("gpt2", seed=7)
    try:
        for _ in range(2):  # the second run starts where the first left its lanes' bookkeeping
            torch.manual_seed(7)
            got = unpack_outputs(graph, ex(env).outputs)
            for a, b in zip(got.outputs, outs, strict=True):
                assert_close(a, b.detach(), rtol=1e-5, atol=1e-6)
            for n, g in got.grads.items():
                assert_close(g, grads[n], rtol=1e-5, atol=1e-6)
    finally:
        ex.started = [lane._thread for lane in ex.lanes.values() if lane._thread is not None]  # type: ignore[attr-defined]
        ex.close()
    used, tasks = ex.lane_runner.lane_tasks(0, len(plan.steps))
    assert ex.lane_runner._plans.keys() == {(0, len(plan.steps))}, "one lanes run per call: the whole plan"
    return ex, positions, sum(lane.kind == "cuda" for *_, lane, _, _ in tasks)


@pytest.mark.parametrize("clock", [False, True])
def test_one_event_a_task_and_no_repeated_waits(monkeypatch: pytest.MonkeyPatch, clock: bool) -> None:
    ex, positions, cuda_tasks = run_on_fake_cuda(monkeypatch, clock)
    counts = FakeEvent.counts
    assert cuda_tasks > 100  # gpt2's plan: most tasks are on the compute and copy lanes
    # per task one event marks it done on its stream; the clock's two around it, its end one doubling as that
    assert counts["record"] == 2 * cuda_tasks * (2 if clock else 1)
    assert counts["own_wait"] == 0 and counts["repeated_wait"] == 0
    assert 0 < counts["wait_event"] < 2 * cuda_tasks  # fewer waits than tasks a run (counts are over two runs)
    assert counts["synchronize"] == 0  # no host lane: nothing blocks the host on the device
    assert positions.unordered(ex) == []
    assert len(positions.at) == sum(not k.startswith("free:") for k in ex.lane_of)


def test_the_order_check_sees_a_missing_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    """The vector-clock check is not vacuous: with the compute lanes' waits on the copy lanes dropped, it finds the
    computes that read a copied value before its copy was ordered before them."""
    from xsched.execute import workers

    wait = workers.Lane.wait

    def forgetful(self: workers.Lane, dep: workers.Done) -> None:
        if self.name.startswith("compute:") and any(k.startswith("copy:") for k in dep.cuda):
            dep.event.wait()  # the host waits, the stream does not
            return
        wait(self, dep)

    monkeypatch.setattr(workers.Lane, "wait", forgetful)
    ex, positions, _ = run_on_fake_cuda(monkeypatch, clock=False)
    bad = positions.unordered(ex)
    assert bad and all(ex.lane_of[i].startswith("compute:") and ex.lane_of[j].startswith("copy:") for i, j in bad)


def test_compute_lanes_run_generated_programs_with_the_step_functions_numbers() -> None:
    """On lanes each compute-lane task is one generated program (xsched.execute.program, the store's locked put and
    drop: the copy and free lanes share it): the same tensors bit for bit as the step functions on lanes, and the same
    bytes resident at the end (the simulator's)."""
    z, graph = workload("gpt2")
    plan = recompute_plan("gpt2", TWO, 50)
    env = bind_inputs(graph, z.model, z.inputs)
    programs = Executor(graph, plan, overlap=True)
    steps = Executor(graph, plan, table={Compute: lambda ex, i, s: prepare_compute(ex, i, s)}, overlap=True)
    assert programs.generate and not steps.generate
    runs = []
    for ex in (programs, steps):
        torch.manual_seed(7)
        st = ex.start(env)
        ex.run(st)
        runs.append((st, ex.outputs(st)))
        ex.close()
    _, tasks = programs.lane_runner.lane_tasks(0, len(plan.steps))
    kinds = {
        fn.__code__.co_filename.startswith("<xsched program") for _, _, lane, fn, _ in tasks if "compute:" in lane.name
    }
    assert kinds == {True}
    (st_a, got), (st_b, want) = runs
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)
    assert st_a.resident() == st_b.resident() == simulate(graph, plan).resident_after[-1]


class _Ev:
    def __init__(self, log: list[str], name: str) -> None:
        self.log, self.name = log, name

    def synchronize(self) -> None:
        self.log.append(self.name)


def test_a_host_lane_synchronizes_each_event_once_and_a_new_run_again() -> None:
    """A host lane blocks on a dependency's CUDA events, skipping one at or before an event of the same lane it
    synchronised this run; `begin` (a new run) forgets them."""
    log: list[str] = []
    lane = Lane("copy:cuda:0->cpu:0", "host")

    def done(**events: tuple[int, str]) -> Done:
        d = Done()
        d.finish(cuda={k.replace("_", ":"): (i, _Ev(log, n)) for k, (i, n) in events.items()})
        return d

    lane.begin()
    lane.wait(done(compute_a=(5, "a5"), copy_b=(3, "b3")))
    lane.wait(done(compute_a=(4, "a4"), copy_b=(7, "b7")))  # a4: before a5, complete
    lane.wait(done(compute_a=(5, "a5 again")))
    assert log == ["a5", "b3", "b7"]
    lane.begin()
    lane.wait(done(compute_a=(4, "a4")))
    assert log[-1] == "a4"
