"""Every path that measures a profile calibrates it back to back (execute.back_to_back.profile_calibrated): wrap,
`xsched train`'s plan cache, `xsched report`, `xsched plan --reprofile`, a capped run; the cap counts the eager steps
and bounds their reps."""

from __future__ import annotations

import logging

import pytest
import torch
from conftest import chain_graph
from torch import nn

import xsched.execute.back_to_back as b2b
from xsched.capture.torch import capture
from xsched.contracts.profile import DeviceInfo, OpCost, Profile
from xsched.execute.wrap import wrap
from xsched.profiling.store import load_profile
from xsched.train.plans import cached_plan

pytestmark = pytest.mark.usefixtures("one_thread")
FAST = {"rounds": 1, "copy_sizes": (1 << 10, 1 << 12)}  # one sweep of the ops, two small copies: cheap


def tiny() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2)), (torch.randn(4, 8),)


def fast_measure(monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """profile_calibrated's profile_graph made cheap, and the devices of each call it makes."""
    calls: list[list[str]] = []
    real = b2b.profile_graph

    def cheap(graph, devices, **kwargs):
        calls.append([str(d) for d in devices])
        return real(graph, devices, **{**kwargs, **FAST})

    monkeypatch.setattr(b2b, "profile_graph", cheap)
    return calls


def no_measuring(*args, **kwargs):
    raise AssertionError("the stored profile must be reused")


def test_one_step_fits_with_its_build_and_warm_up_by_hand() -> None:
    graph = chain_graph([4, 4, 4])
    costs = {op.id: OpCost(t) for op, t in zip(graph.ops, (0.05, 0.03, 0.02))}  # an eager step of 0.1 s
    profile = Profile(graph.fingerprint, {"cpu": DeviceInfo("cpu")}, {"cpu": costs})
    # the build (1 step), WARMUP (2) and one timed step: 0.4 s
    assert [b2b.fits_one_step(s, graph, profile, "cpu") for s in (0.41, 0.39, -1.0)] == [True, False, False]


def test_timed_steps_stop_where_the_next_would_pass_the_seconds_given(monkeypatch) -> None:
    module, inputs = tiny()
    graph = capture(module, inputs)
    calls = []
    real = b2b.Executor.__call__
    monkeypatch.setattr(b2b.Executor, "__call__", lambda self, env: calls.append(1) or real(self, env))
    counts = []
    for within in (None, 1e4, 0.0):
        calls.clear()
        assert b2b.time_eager_step(graph, "cpu", reps=4, within_s=within) > 0
        counts.append(len(calls))
    assert counts == [b2b.WARMUP + 4, b2b.WARMUP + 4, b2b.WARMUP + 1]  # none left: one timed step, not zero


def test_a_capped_profile_counts_its_eager_steps(monkeypatch) -> None:
    module, inputs = tiny()
    graph = capture(module, inputs)
    fast_measure(monkeypatch)
    p = b2b.profile_calibrated(graph, ["cpu"], max_total_s=30.0, progress=False)
    b = p.back_to_back["cpu"]
    assert b.step_s > 0 and b.alone_s == pytest.approx(sum(c.time_s for c in p.compute["cpu"].values()))
    run = p.profiling or {}
    assert run["max_total_s"] == 30.0 and 0 < run["back_to_back_s"] <= run["wall_s"]


def test_a_cap_with_no_room_left_keeps_the_profile_uncalibrated(monkeypatch, caplog) -> None:
    module, inputs = tiny()
    graph = capture(module, inputs)
    fast_measure(monkeypatch)
    with caplog.at_level(logging.WARNING, logger=b2b.__name__):
        p = b2b.profile_calibrated(graph, ["cpu"], max_total_s=0.0, progress=False)
    assert p.back_to_back == {} and "no back-to-back calibration of cpu" in caplog.text


def test_wrap_measures_a_calibrated_profile_once(tmp_path, monkeypatch) -> None:
    module, inputs = tiny()
    calls = fast_measure(monkeypatch)
    w = wrap(module, inputs, {"cpu": "100%"}, method="eager", profile_dir=tmp_path)
    (stored,) = tmp_path.glob("*.json")
    profile = load_profile(stored, w.graph, ["cpu"])
    assert calls == [["cpu"]] and profile.back_to_back["cpu"].step_s > 0
    monkeypatch.setattr(b2b, "profile_graph", no_measuring)
    again = wrap(module, inputs, {"cpu": "100%"}, method="eager", profile_dir=tmp_path)
    assert again.plan.steps == w.plan.steps


def test_trains_plan_cache_is_calibrated_and_found_again(tmp_path, monkeypatch) -> None:
    """`xsched train`'s plans are keyed on the profile's numbers: the calibrated profile is stored once, so the
    second call finds the plan the first one cached."""
    module, inputs = tiny()
    graph = capture(module, inputs)
    calls = fast_measure(monkeypatch)
    how = dict(method="eager", cache_dir=tmp_path, notice=no_measuring, stores=["cpu:1"])
    first = cached_plan(graph, {"cpu:0": "100%"}, ["cpu:0"], **how)
    assert calls == [["cpu:0"]] and not first.reused
    assert set(first.profile.back_to_back) == {"cpu:0"} and first.profile.is_store("cpu:1")
    monkeypatch.setattr(b2b, "profile_graph", no_measuring)
    again = cached_plan(graph, {"cpu:0": "100%"}, ["cpu:0"], **how)
    assert again.reused and again.path == first.path and again.profile.to_dict() == first.profile.to_dict()


@pytest.mark.parametrize("share", [0.3, 1.0, 2.0])  # of the uncapped profile (below, its first op's set-up overruns)
@pytest.mark.parametrize("slower", [1.0, 2.5])  # a step back to back as long as its ops alone, or longer (a CPU)
def test_a_capped_profile_and_its_steps_hold_the_cap_on_a_fake_clock(monkeypatch, share, slower) -> None:
    """profile_graph's cap test (tests/test_profiling_cap.py) with the steps counted: a device of kind "cpu" on
    a fake clock measures the ops, the executor runs the real eager step and each step advances the clock by
    `slower` x the sum of the ops alone. The whole run (ops and steps) keeps within the cap as profile_graph
    does alone (10%)."""
    from test_profiling_cap import FakeClock, Slow

    from xsched.profiling import timecap

    clock = FakeClock()
    monkeypatch.setattr(timecap, "clock", clock)
    module, inputs = tiny()
    graph = capture(module, inputs)

    class SlowCpu(Slow):
        kind = "cpu"  # the executor runs it (on the torch CPU)

    t0 = clock()
    alone = b2b.profile_graph(graph, [SlowCpu("cpu", clock)], progress=False)
    full = clock() - t0
    step = slower * sum(c.time_s for c in alone.compute["cpu"].values())
    real = b2b.Executor.__call__
    monkeypatch.setattr(b2b.Executor, "__call__", lambda self, env: clock.advance(step) or real(self, env))
    cap = share * full
    t0 = clock()
    p = b2b.profile_calibrated(graph, [SlowCpu("cpu", clock)], max_total_s=cap, progress=False)
    spent = clock() - t0
    assert p.profiling["wall_s"] == pytest.approx(spent, abs=1e-3) and spent <= 1.1 * cap + 1e-9, (spent, cap)
    if share >= 2.0:  # room left for the steps: calibrated (at 1.0 the ops take the profile's share of the cap)
        assert p.back_to_back["cpu"].step_s == pytest.approx(step)


MODEL_FILE = """
import torch
from torch import nn

def factory(batch=4):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2)), (torch.randn(batch, 8),)
"""


@pytest.mark.parametrize("calibrate", [True, False])
def test_report_calibrates_the_cpu_it_measures_unless_told_not_to(tmp_path, monkeypatch, calibrate) -> None:
    """`xsched report` measures the real devices of its machines: into a new profile, or added to a given one; both
    calibrated back to back, neither with --no-back-to-back (the simulated GPU is modelled either way)."""
    pytest.importorskip("matplotlib")
    import xsched.profiling.measure as measure
    from xsched.cli import main
    from xsched.contracts.profile import Profile
    from xsched.loaders import load_graph

    calls = fast_measure(monkeypatch)
    monkeypatch.setattr(measure, "profile_graph", b2b.profile_graph)  # the plain path as cheap
    src = tmp_path / "m.py"
    src.write_text(MODEL_FILE)
    spec = f"{src}:factory"
    given = tmp_path / "sim.json"
    measure.profile_graph(load_graph(spec), ["sim:rtx4090"], progress=False).save(given)
    for k, extra in enumerate(([], ["--profile", str(given)])):  # a new profile; the given one with cpu added
        calls.clear()
        out = tmp_path / f"report{k}"
        argv = ["report", spec, "--machine", "sim:rtx4090+cpu", "-o", str(out), "--sections", "whatif"]
        argv += ["--method", "eager", "--baselines", "", "--points", "2", "--quiet", *extra]
        assert main(argv + ([] if calibrate else ["--no-back-to-back"])) == 0
        profile = Profile.load(out / "profile.json")
        assert calls == [["sim:rtx4090", "cpu"] if k == 0 else ["cpu"]]
        assert set(profile.devices) == {"sim:rtx4090", "cpu"}
        assert set(profile.back_to_back) == ({"cpu"} if calibrate else set())
        if calibrate:
            assert profile.back_to_back["cpu"].step_s > 0


def test_plans_reprofile_of_a_stale_profile_is_calibrated(tmp_path, monkeypatch) -> None:
    """`xsched plan --reprofile` measures a stale profile again as `xsched profile` would: calibrated."""
    import json

    from xsched.cli import main
    from xsched.contracts.profile import Profile

    module, inputs = tiny()
    graph = capture(module, inputs)
    graph.save(tmp_path / "g.json")
    stale = b2b.profile_graph(graph, ["cpu"], progress=False, **FAST).to_dict()
    stale["torch_version"] = "1.0.0"  # measured with another torch: stale here
    (tmp_path / "p.json").write_text(json.dumps(stale))
    calls = fast_measure(monkeypatch)
    argv = ["plan", str(tmp_path / "g.json"), str(tmp_path / "p.json"), "--method", "eager"]
    assert main([*argv, "-o", str(tmp_path / "plan.json"), "--reprofile"]) == 0
    assert calls == [["cpu"]] and Profile.load(tmp_path / "p.json").back_to_back["cpu"].step_s > 0
