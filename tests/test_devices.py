"""Device registry (entry points), the CPU plugin, the timer, the link fit and the RAPL reader."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import math
import textwrap
import time

import pytest
import torch

import xsched.devices.cpu as cpu_mod
from xsched.contracts.graph import Graph, Op, Value
from xsched.devices import (
    Device,
    DeviceError,
    Policy,
    available_devices,
    fit_link,
    get_device,
    installed_kinds,
    plugin,
    plugins,
)
from xsched.devices.base import Measurement, parse_options, relative_spread, repeat_until_stable, split_device_list
from xsched.devices.cpu import CpuDevice, thread_clock
from xsched.devices.energy import RaplReader, modelled_energy
from xsched.devices.sim import SimDevice

FAST = Policy(warmup=1, min_reps=2, max_reps=4, max_time_s=0.01, min_sample_s=1e-5)


def mm_graph(m: int = 16, k: int = 32, n: int = 8) -> Graph:
    values = (
        Value("a", m * k * 4, "input", (m, k), "float32"),
        Value("b", k * n * 4, "param", (k, n), "float32"),
        Value("c", m * n * 4, "activation", (m, n), "float32"),
    )
    call = {"args": [{"ref": "a"}, {"ref": "b"}], "kwargs": {}, "outs": [[]]}
    return Graph("mm", values, (Op("op0", "aten.mm.default", ("a", "b"), ("c",), call=call),), ("c",))


# ---- registry ----
@pytest.mark.parametrize("installed", [True, False])
def test_builtin_plugins_need_no_entry_points(installed, monkeypatch):
    """A source checkout on PYTHONPATH (no xsched distribution, so no entry points) finds the built-in plugins as an
    installed one does (issue 33: the GPU benchmark died with `installed kinds: none`)."""
    if not installed:
        monkeypatch.setattr(importlib.metadata, "entry_points", lambda **kw: [])
    assert installed_kinds() == ["cpu", "cuda", "ort", "sim"] or installed
    found = plugins()
    assert {"cpu", "cuda", "sim", "ort"} <= set(found)
    assert found["cpu"] is CpuDevice and found["sim"] is SimDevice
    assert isinstance(get_device("cpu"), CpuDevice)
    assert get_device("sim:h100").kind == "sim"


FAKE_PLUGIN = """
from xsched.devices.base import Device, DeviceInfoRow, Measurement

class FakeDevice(Device):
    kind = "fake"

    @property
    def memory_bytes(self):
        return 1 << 20

    @property
    def description(self):
        return "a third-party accelerator"

    def fingerprint_parts(self):
        return {"model": "fake-1"}

    def measure_op(self, graph, op, policy=None):
        return Measurement(1e-3 * (1 + len(op.inputs)), 0.5, "model")

    def copy_seconds(self, other, nbytes, *, outgoing, pinned=True):
        return 1e-6 + nbytes / 1e9

    @classmethod
    def discover(cls):
        return [DeviceInfoRow("fake:0", "fake", "a third-party accelerator", 1 << 20)]

class NotADevice:
    pass

raise_on_import = False
"""


@pytest.fixture
def third_party(tmp_path, monkeypatch):
    """An installed distribution (dist-info with entry_points.txt) registering plugins in xsched.devices."""
    (tmp_path / "fakeplug_mod.py").write_text(FAKE_PLUGIN)
    (tmp_path / "fakeplug_broken.py").write_text("raise ImportError('missing vendor SDK')\n")
    dist = tmp_path / "fakeplug-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: fakeplug\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(
        textwrap.dedent("""\
        [xsched.devices]
        fake = fakeplug_mod:FakeDevice
        notdev = fakeplug_mod:NotADevice
        broken = fakeplug_broken:Thing
        """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    yield
    importlib.invalidate_caches()


def test_third_party_plugin_is_found_through_its_entry_point(third_party):
    dev = get_device("fake:0")
    assert type(dev).__name__ == "FakeDevice" and dev.kind == "fake" and dev.name == "fake:0"
    assert "fake" in plugins() and "notdev" not in plugins() and "broken" not in plugins()
    assert any(r.name == "fake:0" for r in available_devices())
    from xsched.profiling.measure import profile_graph

    p = profile_graph(mm_graph(), ["fake:0", "sim:h100"], progress=False)
    assert p.compute["fake:0"]["op0"].time_s == pytest.approx(3e-3)
    assert p.link("fake:0", "sim:h100") is not None and p.link("sim:h100", "fake:0") is not None


def test_broken_or_wrong_plugins_are_clear_errors(third_party):
    with pytest.raises(DeviceError, match="failed to load: ImportError: missing vendor SDK") as e:
        get_device("broken")
    assert e.value.stage == "devices" and e.value.device == "broken"
    with pytest.raises(DeviceError, match="not a xsched Device subclass"):
        plugin("notdev")


def test_unknown_kind_names_the_installed_ones():
    with pytest.raises(DeviceError, match=r"unknown device kind 'tpu'; installed kinds: .*cpu.*cuda.*sim") as e:
        get_device("tpu:0")
    assert e.value.device == "tpu" and e.value.stage == "devices"
    with pytest.raises(DeviceError, match="non-empty"):
        get_device("  ")


@pytest.mark.parametrize(
    "name,match",
    [
        ("cpu:threads=0", "positive integer"),
        ("cpu:threads=x", "positive integer"),
        ("cpu:speed=3", "bad device option"),
        ("cpu:threads", "bad device option"),
    ],
)
def test_bad_cpu_options(name, match):
    with pytest.raises(DeviceError, match=match):
        get_device(name)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_cuda_without_a_gpu_is_a_clear_error():
    with pytest.raises(DeviceError, match="CUDA is not available") as e:
        get_device("cuda:0")
    assert e.value.device == "cuda:0"
    with pytest.raises(DeviceError, match="cuda or cuda:<index>"):
        get_device("cuda:x")


def test_parse_options_and_device_lists():
    assert parse_options("cpu:threads=4", ["threads"]) == {"threads": "4"}
    assert parse_options("cpu", ["threads"]) == {}
    text = "cpu:threads=1,clock=thread, cuda:0,sim:h100#1,cpu"
    assert split_device_list(text) == ["cpu:threads=1,clock=thread", "cuda:0", "sim:h100#1", "cpu"]


def test_thread_clock_needs_one_thread_and_counts_cpu_time():
    with pytest.raises(DeviceError, match="needs threads=1"):
        get_device("cpu:clock=thread")
    with pytest.raises(DeviceError, match="clock must be wall or thread"):
        get_device("cpu:threads=1,clock=sundial")
    dev = get_device("cpu:threads=1,clock=thread")
    assert dev.fingerprint_parts()["clock"] == "thread" != get_device("cpu:threads=1").fingerprint_parts()["clock"]
    assert thread_clock(lambda: time.sleep(0.02), 1) < 0.01  # sleeping (like being descheduled) costs no CPU time
    g = mm_graph(64, 64, 64)
    assert dev.measure_op(g, g.op["op0"], FAST).time_s > 0


def test_available_devices_lists_this_cpu_and_the_specs():
    rows = {r.name: r for r in available_devices()}
    assert rows["cpu"].kind == "cpu" and rows["cpu"].memory_bytes > 0 and rows["cpu"].details["logical_cores"] >= 1
    assert {"sim:h100-sxm", "sim:t4", "sim:iris-xe-max", "sim:uhd-p630"} <= set(rows)
    assert not any(r.kind == "sim" for r in available_devices(include_sim=False))


# ---- CPU plugin ----
def test_cpu_fingerprint_is_stable_and_sees_threads():
    a, b, c = get_device("cpu:threads=1"), get_device("cpu:threads=1"), get_device("cpu:threads=2")
    assert a.fingerprint == b.fingerprint != c.fingerprint
    parts = a.fingerprint_parts()
    assert parts["threads"] == "1" and parts["torch"] == torch.__version__ and parts["brand"]
    assert a.info().kind == "cpu" and a.info().extra["fingerprint_parts"] == parts


def test_cpu_measures_with_its_threads_and_restores_them(monkeypatch):
    from xsched.contracts import torch_ops as ops

    seen, real = [], ops.run_op
    monkeypatch.setattr(ops, "run_op", lambda *a, **k: (seen.append(torch.get_num_threads()), real(*a, **k))[1])
    before = torch.get_num_threads()
    m = get_device("cpu:threads=1").measure_op(mm_graph(), mm_graph().op["op0"], FAST)
    assert set(seen) == {1} and torch.get_num_threads() == before
    assert m.time_s > 0 and m.reps >= 2 and m.workspace_bytes == 0


def test_cpu_energy_is_rapl_when_readable_else_model(monkeypatch, tmp_path):
    g = mm_graph()
    monkeypatch.setattr(cpu_mod, "rapl", lambda: RaplReader(tmp_path / "none"))
    m = get_device("cpu").measure_op(g, g.op["op0"], FAST)
    assert m.energy_source == "model" and m.energy_j > 0
    dev = get_device("cpu")
    util = dev.effective_threads / cpu_mod.cpu_model()["logical_cores"]
    assert m.energy_j == pytest.approx(modelled_energy(m.time_s, dev.power, util))
    _rapl_tree(tmp_path / "rapl", {"intel-rapl:0": (5_000, 10_000)})
    monkeypatch.setattr(cpu_mod, "rapl", lambda: RaplReader(tmp_path / "rapl"))
    m = get_device("cpu").measure_op(g, g.op["op0"], FAST)
    assert m.energy_source == "rapl" and m.energy_j == 0.0  # the fake counter does not move


def two_op_graph(bad: bool = False) -> Graph:
    """mm then relu; with bad, the relu is given an unknown target, so it cannot run."""
    g = mm_graph()
    relu = Op("op1", "aten.nonexistent_op.default" if bad else "aten.relu.default", ("c",), ("d",))
    relu = dataclasses.replace(relu, call={"args": [{"ref": "c"}], "kwargs": {}, "outs": [[]]})
    d = Value("d", g.value["c"].nbytes, "activation", g.value["c"].shape, "float32")
    return Graph("mm_relu", (*g.values, d), (*g.ops, relu), ("d",))


def test_cpu_measure_ops_interleaves_the_ops(monkeypatch):
    from xsched.contracts import torch_ops as ops

    seen, real = [], ops.run_op
    monkeypatch.setattr(ops, "run_op", lambda op, *a, **k: (seen.append(op.id), real(op, *a, **k))[1])
    g = two_op_graph()
    policy = Policy(warmup=1, min_reps=3, max_reps=3, max_time_s=10.0)
    found = get_device("cpu:threads=1").measure_ops(g, g.ops, policy)
    # one set-up call each, then one warm-up sweep and three timed sweeps, each op once per sweep, in graph order
    assert seen == ["op0", "op1"] * (1 + 1 + 3)
    assert all(isinstance(m, Measurement) and m.time_s > 0 and m.reps == 3 for m in found)


def test_cpu_measure_ops_leaves_out_what_cannot_run_and_splits_big_sweeps(monkeypatch):
    g = two_op_graph(bad=True)
    found = get_device("cpu").measure_ops(g, g.ops, FAST)
    assert isinstance(found[0], Measurement) and found[0].time_s > 0
    assert isinstance(found[1], str) and "op1" in found[1]
    monkeypatch.setattr(cpu_mod, "SWEEP_BYTES", 1)  # every op a sweep of its own: still one result per op, in order
    g = two_op_graph()
    assert [m.reps > 0 for m in get_device("cpu").measure_ops(g, g.ops, FAST)] == [True, True]  # type: ignore[union-attr]


def test_cpu_measure_ops_energy_is_rapl_when_readable(monkeypatch, tmp_path):
    g = two_op_graph()
    _rapl_tree(tmp_path / "rapl", {"intel-rapl:0": (5_000, 10_000)})
    monkeypatch.setattr(cpu_mod, "rapl", lambda: RaplReader(tmp_path / "rapl"))
    assert {m.energy_source for m in get_device("cpu").measure_ops(g, g.ops, FAST)} == {"rapl"}  # type: ignore[union-attr]
    monkeypatch.setattr(cpu_mod, "rapl", lambda: RaplReader(tmp_path / "none"))
    assert {m.energy_source for m in get_device("cpu").measure_ops(g, g.ops, FAST)} == {"model"}  # type: ignore[union-attr]


def test_cpu_to_cpu_copy_is_a_timed_memcpy():
    a, b = get_device("cpu"), get_device("cpu:threads=1")
    small, big = a.copy_seconds(b, 1 << 10, outgoing=True), a.copy_seconds(b, 16 << 20, outgoing=True)
    assert 0 < small < big
    assert a.copy_seconds(get_device("sim:h100"), 1024, outgoing=True) is None  # the sim plugin answers that one


def test_logical_cpus_are_profiled_under_their_own_names():
    """ "cpu:0" and "cpu:1,threads=1" are the CPU under the names a plan uses: op costs for each, a link each way."""
    from xsched.profiling.measure import profile_graph

    one = get_device("cpu:1,threads=1")
    assert (one.name, one.index, one.threads) == ("cpu:1,threads=1", 1, 1)
    assert get_device("cpu").index is None
    with pytest.raises(DeviceError, match="bad device option"):
        get_device("cpu:1,x")
    g = mm_graph()
    p = profile_graph(g, ["cpu:0", "cpu:1"], policy=FAST, rounds=1, progress=False)
    assert set(p.compute) == {"cpu:0", "cpu:1"} and all(p.op_cost("op0", d).time_s > 0 for d in p.compute)
    assert p.copy_time("c", 1 << 20, "cpu:0", "cpu:1") > 0 and p.copy_time("c", 1 << 20, "cpu:1", "cpu:0") > 0


# ---- timing and fitting ----
def test_repeat_until_stable_stops_when_stable_or_capped():
    calls = []

    def clock(call, n):
        calls.append(n)
        return 1e-3 * n

    samples = repeat_until_stable(lambda: None, Policy(warmup=2, min_reps=5, max_reps=50, max_time_s=10), clock)
    assert len(samples) == 5 and all(s == pytest.approx(1e-3) for s in samples)
    noisy = iter([1e-3, 5e-3] * 100)
    samples = repeat_until_stable(
        lambda: None, Policy(warmup=0, min_reps=3, max_reps=50, max_time_s=0.02), lambda c, n: next(noisy) * n
    )
    assert 3 <= len(samples) < 50  # spread never settles: the time cap ends it
    slow = repeat_until_stable(lambda: None, Policy(warmup=0, min_reps=5, max_time_s=0.5), lambda c, n: 1.0 * n)
    assert len(slow) == 1  # an op slower than the cap is measured once, not min_reps times


def test_short_calls_are_batched_into_longer_samples():
    ns = []
    repeat_until_stable(
        lambda: None, Policy(warmup=0, min_reps=2, min_sample_s=1e-3), lambda c, n: (ns.append(n), 1e-5 * n)[1]
    )
    assert ns[0] == 1 and all(n == 100 for n in ns[1:])


def test_fit_link_recovers_latency_and_bandwidth():
    sizes = [1 << 10, 1 << 16, 1 << 20, 1 << 24]
    lat, bw = fit_link(sizes, [5e-6 + n / 12e9 for n in sizes])
    assert lat == pytest.approx(5e-6) and bw == pytest.approx(12e9)
    lat, bw = fit_link(sizes, [n / 3e9 * (1 - 0.02 * (i == 0)) for i, n in enumerate(sizes)])
    assert lat == 0.0 and bw == pytest.approx(3e9, rel=0.02)  # a negative intercept is noise: refit through 0
    noisy = [(2e-6 + n / 20e9) * (1 + 0.05 * (-1) ** i) for i, n in enumerate(sizes)]  # +-5% on every point
    lat, bw = fit_link(sizes, noisy)  # relative weights: the latency comes from the small copies, not swamped
    assert lat == pytest.approx(2e-6, rel=0.15) and bw == pytest.approx(20e9, rel=0.1)
    with pytest.raises(ValueError):
        fit_link([1], [1.0])


def test_relative_spread():
    assert relative_spread([1.0, 1.0, 1.0]) == 0.0 and math.isinf(relative_spread([1.0]))


# ---- RAPL ----
def _rapl_tree(root, domains):
    for name, (energy, max_range) in domains.items():
        d = root / name
        d.mkdir(parents=True, exist_ok=True)
        (d / "energy_uj").write_text(f"{energy}\n")
        (d / "max_energy_range_uj").write_text(f"{max_range}\n")
        (d / "name").write_text("package-0\n")
    return root


def test_rapl_sums_packages_and_handles_wrap_around(tmp_path):
    root = _rapl_tree(
        tmp_path,
        {"intel-rapl:0": (9_000_000, 10_000_000), "intel-rapl:1": (100, 10_000_000), "intel-rapl:0:0": (5, 10_000_000)},
    )  # a subdomain: inside package 0, not added
    (tmp_path / "intel-rapl:2").mkdir()  # no counter files (unreadable): skipped
    r = RaplReader(root)
    assert r.available and len(r.domains) == 2
    before = r.snapshot()
    (root / "intel-rapl:0" / "energy_uj").write_text("500000\n")  # wrapped: 9.0 J -> 10.0 J (wrap) -> 0.5 J
    (root / "intel-rapl:1" / "energy_uj").write_text("2000100\n")  # +2 J
    assert r.joules(before, r.snapshot()) == pytest.approx(1.5 + 2.0)


def test_rapl_absent_is_not_available(tmp_path):
    assert not RaplReader(tmp_path / "missing").available


def test_modelled_energy():
    assert modelled_energy(2.0, {"idle_power_w": 10, "max_power_w": 110}, 0.5) == pytest.approx(120.0)
    assert modelled_energy(1.0, {"idle_power_w": 10, "max_power_w": 110}, 3.0) == pytest.approx(110.0)


def test_device_is_abstract():
    with pytest.raises(TypeError):
        Device("x")  # type: ignore[abstract]
