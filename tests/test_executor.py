"""The multi-stream executor on zoo models against eager PyTorch, the reference interpreter and the simulator, on one
and two logical CPU devices; its measurement and `xsched run`."""

from __future__ import annotations

import pytest
import torch
from executor_support import (
    TWO,
    ZOO,
    check_against_eager,
    eager_plan_on,
    homes_on,
    recompute_plan,
    unit_profile,
    workload,
)

from xsched import zoo
from xsched.capture.torch import bind_inputs
from xsched.contracts.plan import Compute, Copy
from xsched.errors import XschedError
from xsched.execute.executor import Executor
from xsched.execute.reference import execute
from xsched.execute.run_report import measure
from xsched.simulate import simulate
from xsched.solve.api import solve
from xsched.solve.bounds.memory import lower_bounds
from xsched.solve.options import SolverOptions
from xsched.solve.reference import eager_peak

pytestmark = pytest.mark.usefixtures("one_thread")


# on two devices, resnet34 and resnet50 add nothing resnet18 does not run (the same residual blocks and copies at
# two and three times the ops): left out for the suite's time; on one device every model runs
ZOO_CASES = [
    (n, d) for n in zoo.names() for d in (("cpu:0",), TWO) if d == ("cpu:0",) or n not in ("resnet34", "resnet50")
]


@pytest.mark.parametrize(
    ("name", "devices"), ZOO_CASES, ids=[f"{n}-{'one' if len(d) == 1 else 'two'}" for n, d in ZOO_CASES]
)
def test_zoo_matches_eager_pytorch(name: str, devices: tuple[str, ...]) -> None:
    """Outputs, grads and buffers equal eager PyTorch under the eager plan and the 50% and 25% recomputation
    plans; with trace the bytes resident after every step equal the simulator's; without it, on two devices, the
    default run (in plan order, one-device runs as generated programs) and the lanes (overlapping) give them too
    (at 50%)."""
    graph = workload(name)[1]
    for percent in (100, 50, 25):
        plan = eager_plan_on(graph, devices) if percent == 100 else recompute_plan(name, devices, percent)
        if len(devices) == 2:
            assert any(isinstance(s, Copy) for s in plan.steps)
        check_against_eager(name, plan, trace=True).close()
        if len(devices) == 2 and percent == 50:  # the two untraced modes once per model (the suite's time)
            check_against_eager(name, plan, trace=False, overlap=None).close()
            check_against_eager(name, plan, trace=False, overlap=True).close()


@pytest.mark.parametrize(("name", "percent", "variant"), [("mlp_mixer", 28, "lean late keep"), ("unet", 29, "window")])
def test_lean_checkpointing_fits_below_the_checkpoint_floor_and_matches_eager(name, percent, variant) -> None:
    """Below what checkpointing and eviction reach (ZOO's floor is above `percent`), the checkpoint search's last
    resort fits: lean checkpointing with weight gradients made late (mlp_mixer), or a window of the backward made
    again at the end (unet). Its plan gives eager PyTorch's outputs, gradients and buffers, and the bytes resident
    after every step are the simulator's."""
    graph = workload(name)[1]
    devices = ("cpu:0",)
    budgets = {"cpu:0": eager_peak(graph) * percent // 100}
    # no time limit: the variant is the search's, not what a loaded machine reaches in the default 60 s
    full = SolverOptions(time_limit_s=None)
    plan = solve(
        graph, unit_profile(graph, devices), budgets, devices, "checkpoint", full, homes=homes_on(graph, devices)
    )
    assert variant in plan.solver.stats.variant and plan.predicted.peak_bytes["cpu:0"] <= budgets["cpu:0"]
    check_against_eager(name, plan, trace=True).close()


def test_greedy_split_across_two_devices_overlaps_and_stays_within_plan_memory() -> None:
    """Ops on both devices (greedy fill), run concurrently: eager numbers, peaks within the simulator's."""
    _, graph = workload("gpt2")
    prof = unit_profile(graph, TWO)
    low = lower_bounds(graph, prof, TWO, {v: "cpu:0" for v in graph.inputs})["cpu:0"].bytes
    peak = eager_plan_on(graph, ("cpu:0",)).predicted.peak_bytes["cpu:0"]
    plan = solve(graph, prof, {"cpu:0": (low + peak) // 2, "cpu:1": peak}, TWO, "greedy")
    assert {s.device for s in plan.steps if isinstance(s, Compute)} == set(TWO)
    z = workload("gpt2")[0]
    ex = check_against_eager("gpt2", plan, trace=False)
    st = ex.start(bind_inputs(graph, z.model, z.inputs))
    ex.run(st)
    sim = simulate(graph, plan)
    for d, peak in st.peak().items():
        assert peak <= sim.peak_bytes[d]
    ex.close()


def test_inplace_reuse_is_bitwise_and_keeps_the_accounting() -> None:
    """Elementwise ops run in place on an input the plan frees right after them: the same outputs bit for bit
    and the same bytes resident after every step (the simulator's) as running every op out of place."""
    for name, percent in (("resnet18", 100), ("gpt2", 100), ("gpt2", 50)):
        z, graph = workload(name)
        plan = eager_plan_on(graph, ("cpu:0",)) if percent == 100 else recompute_plan(name, ("cpu:0",), percent)
        env = bind_inputs(graph, z.model, z.inputs)
        on, off = Executor(graph, plan, overlap=True), Executor(graph, plan, inplace=False, overlap=True)
        assert on.reuse and not off.reuse
        assert {graph.op[plan.steps[i].op].target for i in on.reuse} >= {"aten.add.Tensor"}
        torch.manual_seed(5)
        a = on(env, trace=True)
        torch.manual_seed(5)
        b = off(env, trace=True)
        assert a.resident_after == b.resident_after == simulate(graph, plan).resident_after
        assert a.outputs.keys() == b.outputs.keys()
        for k, t in a.outputs.items():
            assert torch.equal(t, b.outputs[k]), k


def test_matches_reference_interpreter_on_two_devices() -> None:
    _, graph = workload("vgg16")
    z = workload("vgg16")[0]
    plan = eager_plan_on(graph, TWO)
    env = bind_inputs(graph, z.model, z.inputs)
    torch.manual_seed(3)  # vgg16 has dropout: both runs draw from the same generator state
    ref = execute(graph, plan, env)
    ex = Executor(graph, plan, overlap=True)
    torch.manual_seed(3)
    got = ex(env, trace=True)
    assert got.resident_after == ref.resident_after
    for k, t in ref.outputs.items():
        assert torch.equal(t, got.outputs[k])
    ex.close()


def test_logical_cpus_run_in_plan_order_in_the_calling_thread_unless_asked() -> None:
    """Two logical CPUs share one CPU: by default the plan runs in the calling thread (no lane starts), with the
    overlapped run's numbers; `overlap=True` starts the lanes."""
    z, graph = workload("gpt2")
    plan = recompute_plan("gpt2", TWO, 50)
    env = bind_inputs(graph, z.model, z.inputs)
    runs = {}
    for overlap in (None, True):
        ex = Executor(graph, plan, overlap=overlap)
        torch.manual_seed(7)
        runs[overlap] = ex(env).outputs
        started = [k for k, lane in ex.lanes.items() if lane._thread is not None]
        assert bool(started) == bool(overlap), started
        ex.close()
    for k, t in runs[None].items():
        assert torch.equal(t, runs[True][k]), k


# ---- measurement ----
def test_measure_reports_accounting_peaks_and_predictions() -> None:
    z, graph = workload("gpt2")
    plan = eager_plan_on(graph, TWO)
    prof = unit_profile(graph, TWO)
    r = measure(graph, plan, bind_inputs(graph, z.model, z.inputs), prof, iters=2, warmup=1)
    sim = simulate(graph, plan, prof)
    assert r.peak_bytes == sim.peak_bytes  # no workspace in this graph: the accounting peak is the simulator's
    assert set(r.peak_source.values()) == {"executor accounting"}
    assert r.predicted_time_s == sim.time_s and r.predicted_makespan_s == sim.makespan_s
    assert len(r.times_s) == 2 and r.time_s > 0
    assert r.energy_source.startswith("modelled") or r.energy_source in ("rapl", "nvml")
    table = r.table()
    assert "peak cpu:0" in table and "peak cpu:1" in table and "median of 2" in table
    with pytest.raises(XschedError, match="iters"):
        measure(graph, plan, {}, iters=0)


def test_cli_run_prints_predicted_and_measured(tmp_path, capsys) -> None:
    from xsched.cli import main

    _, graph = workload("gpt2")
    plan = eager_plan_on(graph, ("cpu:0",))
    plan.save(tmp_path / "plan.json")
    batch, scale = ZOO["gpt2"][:2]
    argv = ["run", "zoo:gpt2", str(tmp_path / "plan.json"), "--iters", "2", "--scale", scale]
    assert main([*argv, "--batch", str(batch)]) == 0
    out = capsys.readouterr().out
    assert "iteration time" in out and "peak cpu:0" in out and "energy" in out
    assert main([*argv, "--batch", "3"]) == 2  # another batch captures another graph: one line, exit 2
    assert "plan it again" in capsys.readouterr().err
