"""The CUDA plugin on a real GPU (skipped without one): event timing, allocator workspace, NVML energy, copies."""

from __future__ import annotations

import time

import pytest
import torch

from xsched.contracts.graph import Graph, Op, Value
from xsched.devices import Policy, get_device
from xsched.devices.energy import nvml_energy_mj

pytestmark = pytest.mark.gpu
FAST = Policy(warmup=2, min_reps=3, max_reps=10, max_time_s=0.05)


def one_op_graph(target: str, shapes: list[tuple[int, ...]], out: tuple[int, ...]) -> Graph:
    ins = tuple(Value(f"i{k}", 4 * _numel(s), "input", s, "float32") for k, s in enumerate(shapes))
    values = (*ins, Value("o", 4 * _numel(out), "activation", out, "float32"))
    call = {"args": [{"ref": v.id} for v in ins], "kwargs": {}, "outs": [[]]}
    return Graph("one", values, (Op("op0", target, tuple(v.id for v in ins), ("o",), call=call),), ("o",))


def _numel(s: tuple[int, ...]) -> int:
    n = 1
    for x in s:
        n *= x
    return n


def test_identity():
    dev = get_device("cuda:0")
    props = torch.cuda.get_device_properties(0)
    assert dev.memory_bytes == props.total_memory and dev.torch_device == torch.device("cuda", 0)
    assert dev.fingerprint == get_device("cuda").fingerprint and dev.fingerprint_parts()["name"] == props.name
    assert dev.energy_source in ("nvml", "model")


def test_matmul_time_agrees_with_a_direct_event_timing():
    n = 2048
    g = one_op_graph("aten.mm.default", [(n, n), (n, n)], (n, n))
    m = get_device("cuda:0").measure_op(g, g.op["op0"], FAST)
    a = torch.randn(n, n, device="cuda")
    for _ in range(3):
        a @ a
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        a @ a
    end.record()
    end.synchronize()
    direct = start.elapsed_time(end) / 1e3 / 10
    assert 0.5 * direct < m.time_s < 2.0 * direct
    assert m.energy_source in ("nvml", "model") and m.energy_j > 0


def test_elementwise_op_has_no_workspace():
    g = one_op_graph("aten.relu.default", [(1024, 1024)], (1024, 1024))
    assert get_device("cuda:0").measure_op(g, g.op["op0"], FAST).workspace_bytes == 0


@pytest.mark.skipif(
    nvml_energy_mj(get_device("cuda:0").nvml if torch.cuda.is_available() else None) is None,
    reason="NVML energy counter not readable",
)
def test_nvml_energy_is_measured():
    """Where the counter moves over half a second of matrix products, an op's energy comes from it; where it does
    not (a counter too coarse or frozen, as seen on an H200), there is nothing to measure: skipped, saying so."""
    dev = get_device("cuda:0")
    n = 4096
    a = torch.randn(n, n, device="cuda:0")
    before = nvml_energy_mj(dev.nvml)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < 0.5:
        a @ a
    torch.cuda.synchronize()
    if nvml_energy_mj(dev.nvml) <= before:
        pytest.skip("the NVML energy counter is readable but did not move over 0.5 s of matrix products here")
    g = one_op_graph("aten.mm.default", [(n, n), (n, n)], (n, n))
    m = dev.measure_op(g, g.op["op0"], FAST)
    assert m.energy_source == "nvml" and 0 < m.energy_j / m.time_s < 2000  # watts: positive, below any board limit


def test_copies_pinned_pageable_and_both_directions():
    gpu, cpu = get_device("cuda:0"), get_device("cpu")
    n = 64 << 20
    pinned_in = gpu.copy_seconds(cpu, n, outgoing=False, pinned=True)
    pageable_in = gpu.copy_seconds(cpu, n, outgoing=False, pinned=False)
    out = gpu.copy_seconds(cpu, n, outgoing=True, pinned=True)
    assert 0 < pinned_in <= pageable_in * 1.2 and out > 0
    assert n / pinned_in > 1e9  # any PCIe link moves more than 1 GB/s


def test_profile_cpu_and_gpu(tmp_path):
    from xsched.capture.torch import capture
    from xsched.profiling.measure import profile_graph
    from xsched.profiling.store import load_profile, save_profile

    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
    g = capture(model, (torch.randn(32, 64),))
    p = profile_graph(g, ["cpu", "cuda:0"], policy=FAST, rounds=1, progress=False)
    assert set(p.compute["cuda:0"]) == {o.id for o in g.ops}
    assert set(p.copy) == {"cpu->cuda:0", "cuda:0->cpu"}
    assert "pageable" in p.extra["links"]["cpu->cuda:0"]
    # per op: NVML where its counter moved within the policy's window, else modelled ("model+nvml" when both)
    assert set(p.energy_source["cuda:0"].split("+")) <= {"nvml", "model"}
    save_profile(p, tmp_path / "p.json")
    assert load_profile(tmp_path / "p.json", g).to_dict() == p.to_dict()


def test_op_inputs_are_drawn_on_the_gpu():
    from xsched.contracts.torch_ops import op_input_tensors

    g = one_op_graph("aten.relu.default", [(1024, 1024)], (1024, 1024))
    env = op_input_tensors(g, g.op["op0"], torch.device("cuda", 0), torch.Generator().manual_seed(0))
    assert all(t.device == torch.device("cuda", 0) for t in env.values()) and env["i0"].std() > 0.5


def test_profile_the_gpu_with_the_host_as_a_store_under_a_cap():
    """No op on the store, its links both ways; the cap's wall time is checked by scripts/bench_profile_cap.py."""
    from xsched.capture.torch import capture
    from xsched.profiling.measure import profile_graph

    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
    g = capture(model, (torch.randn(32, 64),))
    p = profile_graph(g, ["cuda:0"], stores=["cpu"], policy=FAST, max_total_s=5.0, progress=False)
    assert set(p.compute["cuda:0"]) == {o.id for o in g.ops} and p.is_store("cpu") and p.compute["cpu"] == {}
    assert set(p.copy) == {"cpu->cuda:0", "cuda:0->cpu"} and "pageable" in p.extra["links"]["cuda:0->cpu"]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_device_to_device_copy():
    a, b = get_device("cuda:0"), get_device("cuda:1")
    assert a.copy_seconds(b, 64 << 20, outgoing=True) > 0
