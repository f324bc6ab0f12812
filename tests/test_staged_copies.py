"""The step clock counts the host sources a run's copies stage through new pinned memory (issue 30: a copy from
unpinned host memory is staged on its lane every step). Hand-made plan on logical CPU devices; pinning is a plain
allocation here (the CPU build of torch cannot pin), and the copy kind stages as the CUDA copy path does."""

from __future__ import annotations

import pytest
import torch
from test_executor_steps import _pair_graph, _pair_plan
from torch.testing import assert_close

import xsched.execute.host_pin as host_pin
from xsched.contracts.plan import Copy
from xsched.execute.executor import Executor
from xsched.execute.step_clock import StepClock
from xsched.execute.steps import STEP_KINDS, RunState, pinned

pytestmark = pytest.mark.usefixtures("one_thread")


def staging_copy(ex: Executor, i: int, s: Copy):
    """The plain copy, its source first staged by `pinned` (what the CUDA mover does with a host source)."""
    plain = STEP_KINDS[Copy](ex, i, s)

    def copy(st: RunState) -> None:
        st.stores[s.src].tensors[s.value] = pinned(st.stores[s.src].tensors[s.value], st)
        plain(st)

    return copy


def test_a_run_reports_the_sources_it_staged(monkeypatch) -> None:
    """One copy of `a` (4096 float32: 16 KiB) per run, staged each run: the step's breakdown says 1 copy and its
    bytes; the output is the eager one. Without staging (a pinned source): nothing reported."""
    monkeypatch.setattr(host_pin, "pinned_empty", lambda shape, dtype: torch.empty(shape, dtype=dtype))
    graph, env = _pair_graph()
    ex = Executor(graph, _pair_plan(graph), table={Copy: staging_copy})
    ex.clock = clock = StepClock()
    for _ in range(2):  # every run stages again: the count is per step, not once
        clock.start()
        st = ex.start(env)
        ex.run(st)
        assert_close(st.stores["cpu:1"].tensors["b"], -torch.relu(env["x"]))
        b = clock.read()
        assert (b["staged_copies"], b["staged_bytes"]) == (1.0, 4096 * 4)
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self: True)  # a pinned source goes as it is
    clock.start()
    ex.run(ex.start(env))
    assert clock.read()["staged_copies"] == 0.0
