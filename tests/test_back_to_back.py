"""The profile's back-to-back calibration (contract 2, BackToBack): the field, the fit, and the simulator's counts."""

from __future__ import annotations

import gzip
import json
import math
from pathlib import Path

import pytest
from conftest import chain_graph

from xsched.contracts.graph import Graph
from xsched.contracts.profile import BackToBack, DeviceInfo, OpCost, Profile
from xsched.errors import ProfileError
from xsched.profiling.back_to_back import calibrate, fit_overhead, step_time
from xsched.profiling.fused import fused_profile
from xsched.simulate import simulate
from xsched.solve.api import solve
from xsched.solve.hier.region import sub_profile
from xsched.solve.reference import eager_plan

GPU = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu"
TIMES = {"f0": 10.0, "f1": 3.0, "f2": 1.0}  # seconds alone of the 3-op chain's ops


def chain_profile(graph: Graph, **fields) -> Profile:
    compute = {"d": {o: OpCost(t) for o, t in TIMES.items()}, "host": {}}
    return Profile(graph.fingerprint, {"d": DeviceInfo("cuda"), "host": DeviceInfo("cpu")}, compute, **fields)


def test_the_simulator_counts_each_op_as_the_longer_of_its_kernel_and_the_overhead() -> None:
    graph = chain_graph([4, 4, 4])
    plan = eager_plan(graph, "d")
    calibrated = chain_profile(graph, back_to_back={"d": BackToBack(11.0, 14.0, 2.0)})
    # by hand, overhead 2: f0 kernel 8 > 2 pays 8; f1 kernel 1 < 2 pays 2; f2 (1 s alone, under the overhead) pays 1
    result = simulate(graph, plan, calibrated)
    assert result.time_s == pytest.approx(8 + 2 + 1)
    assert result.makespan_s == pytest.approx(8 + 2 + 1)
    assert simulate(graph, plan, chain_profile(graph)).time_s == pytest.approx(14.0)
    assert calibrated.op_cost("f0", "d").energy_j == 0.0 and calibrated.compute["d"]["f0"].time_s == 10.0


def test_the_fitted_overhead_reproduces_the_measured_step() -> None:
    times = list(TIMES.values())
    assert fit_overhead(times, 14.0) == 0.0  # as fast back to back as alone: no overhead
    assert fit_overhead(times, 20.0) == pytest.approx(-2.0)  # slower: each of the 3 ops pays 2 s more
    assert step_time(times, -2.0) == pytest.approx(20.0)
    for step in (13.0, 11.0):
        o = fit_overhead(times, step)
        assert step_time(times, o) == pytest.approx(step)
        assert all(step_time(times, o * k) > step for k in (0.5, 0.9))  # the smallest overhead that gets there
    # 11 s is the model's fastest step (f0 pays 10 - o, f1 and f2 grow): a faster one gets the best fit
    best = fit_overhead(times, 5.0)
    assert step_time(times, best) == pytest.approx(min(step_time(times, x / 100) for x in range(0, 1001)))


def test_calibrating_the_h100_profile_makes_the_eager_plan_take_the_measured_step() -> None:
    graph = Graph.from_dict(json.loads(gzip.open(GPU / "gpt2-full_n_layer6.graph.json.gz").read()))
    profile = Profile.from_dict(json.loads(gzip.open(GPU / "gpt2-full_n_layer6.h100.profile.json.gz").read()))
    assert profile.back_to_back == {}  # an old file: no calibration
    calibrated = calibrate(graph, profile, {"cuda:0": 0.1214})  # the eager step measured on that H100 (README)
    b = calibrated.back_to_back["cuda:0"]
    assert b.alone_s == pytest.approx(sum(c.time_s for c in profile.compute["cuda:0"].values()))
    plan = eager_plan(graph, "cuda:0")
    assert simulate(graph, plan, calibrated, check_budgets=False).makespan_s == pytest.approx(0.1214)
    assert simulate(graph, plan, profile, check_budgets=False).makespan_s == pytest.approx(b.alone_s)


def test_the_field_round_trips_and_old_files_read(tmp_path) -> None:
    graph = chain_graph([4, 4, 4])
    calibrated = chain_profile(graph, back_to_back={"d": BackToBack(11.0, 14.0, 2.0)})
    calibrated.save(tmp_path / "p.json")
    assert Profile.load(tmp_path / "p.json") == calibrated
    plain = chain_profile(graph)
    assert "back_to_back" not in plain.to_dict()
    assert Profile.from_dict(plain.to_dict()).back_to_back == {}


@pytest.mark.parametrize(
    "raw,match",
    [
        ({"d": {"step_s": -1.0, "alone_s": 2.0, "overhead_s": 1.0}}, r"back_to_back\['d'\] needs finite seconds"),
        ({"d": {"step_s": 1.0, "alone_s": 2.0, "overhead_s": math.inf}}, r"back_to_back\['d'\] needs finite seconds"),
        ({"d": {"step_s": math.nan, "alone_s": 2.0, "overhead_s": 0.0}}, r"back_to_back\['d'\] needs finite"),
        ({"d": {"step_s": "1", "alone_s": 2.0, "overhead_s": 0.0}}, r"back_to_back\['d'\].step_s must be a number"),
        ({"d": {"step_s": 1.0, "alone_s": 2.0}}, r"back_to_back\['d'\] needs exactly step_s, alone_s and overhead_s"),
        ({"host": {"step_s": 1.0, "alone_s": 2.0, "overhead_s": 0.0}}, r"names 'host', which runs no op"),
        ({"tpu": {"step_s": 1.0, "alone_s": 2.0, "overhead_s": 0.0}}, r"names 'tpu', which runs no op"),
        ([1.0], r"'back_to_back' must map devices to their calibration"),
    ],
)
def test_a_bad_calibration_is_one_error(raw, match) -> None:
    base = chain_profile(chain_graph([4, 4, 4])).to_dict()
    with pytest.raises(ProfileError, match=match) as e:
        Profile.from_dict({**base, "back_to_back": raw})
    assert "\n" not in str(e.value)


def test_plans_from_uncalibrated_profiles_are_unchanged() -> None:
    graph = chain_graph([4, 4, 4], train=True)
    compute = {"d": {op.id: OpCost(1.0 + i) for i, op in enumerate(graph.ops)}}
    plain = Profile(graph.fingerprint, {"d": DeviceInfo("cuda")}, compute)
    assert all(plain.op_cost(o, "d") is c for o, c in compute["d"].items())  # no calibration: the costs as stored
    alone = sum(c.time_s for c in compute["d"].values())
    zero = calibrate(graph, plain, {"d": alone})  # back to back as fast as alone: overhead 0, the same times
    assert zero.back_to_back["d"].overhead_s == 0.0
    for method in ("checkpoint", "sqrt"):
        a, b = (solve(graph, p, {"d": "90%"}, method=method) for p in (plain, zero))
        assert a.steps == b.steps


def test_a_region_keeps_the_calibration_of_the_devices_that_run_its_ops() -> None:
    graph = chain_graph([4, 4, 4])
    b = BackToBack(11.0, 14.0, 2.0)
    devices = {"d": DeviceInfo("cuda"), "e": DeviceInfo("cpu")}
    compute = {"d": {o: OpCost(t) for o, t in TIMES.items()}, "e": {"elsewhere": OpCost(1.0)}}
    calibrated = Profile(graph.fingerprint, devices, compute, back_to_back={"d": b, "e": b})
    # e runs no op of the region: its calibration goes with its costs (a calibrated device must run an op)
    assert sub_profile(calibrated, graph).back_to_back == {"d": b}


def test_compiled_pricing_drops_the_calibration_of_its_device() -> None:
    graph = chain_graph([4, 4, 4])
    calibrated = chain_profile(graph, back_to_back={"d": BackToBack(11.0, 14.0, 2.0)})
    assert fused_profile(graph, calibrated, "d").back_to_back == {}
