"""The ONNX Runtime device plugins: names, every node profiled alone, copies between providers, the profile store's
checks; the CUDA provider where there is one."""

from __future__ import annotations

import dataclasses
import json

import pytest
from onnx_models import ort, zoo_onnx

from xsched.capture.onnx import capture_onnx
from xsched.devices import DeviceError, available_devices, get_device
from xsched.devices.base import Policy
from xsched.devices.ort import OrtDevice
from xsched.errors import ProfileError
from xsched.profiling.measure import profile_graph
from xsched.profiling.store import check_profile, load_profile, save_profile

QUICK = Policy(warmup=1, min_reps=3, max_reps=5, max_time_s=0.02, min_sample_s=0.0)


def test_names_and_options():
    d = get_device("ort:cpu")
    assert isinstance(d, OrtDevice) and d.kind == "ort" and d.is_host and d.provider == "CPUExecutionProvider"
    one = get_device("ort:cpu:1,threads=1")
    assert one.index == 1 and one.threads == 1 and one.fingerprint != d.fingerprint
    assert d.fingerprint_parts()["onnxruntime"] == ort.__version__
    assert any(r.name == "ort:cpu" and r.kind == "ort" for r in available_devices(include_sim=False))
    for bad, message in [
        ("ort:tpu", "ort:cpu\\[:N\\] or ort:cuda\\[:N\\]"),
        ("ort:cpu:x", "ort:cpu\\[:N\\]"),
        ("ort:cpu,threads=0", "threads must be a positive integer"),
        ("ort:cpu,speed=9", "bad device option"),
    ]:
        with pytest.raises(DeviceError, match=message) as e:
            get_device(bad)
        assert "\n" not in str(e.value)


@pytest.mark.skipif("CUDAExecutionProvider" in ort.get_available_providers(), reason="this build has CUDA")
def test_cuda_without_the_provider_is_one_line():
    with pytest.raises(DeviceError, match="CUDAExecutionProvider is not available in this onnxruntime") as e:
        get_device("ort:cuda:0")
    assert "\n" not in str(e.value) and e.value.device == "ort:cuda:0"


@pytest.fixture(scope="module")
def graph():
    return capture_onnx(zoo_onnx("resnet18"), name="resnet18")


def test_every_node_is_profiled_alone_and_stored(graph, tmp_path):
    names = ["ort:cpu:0", "ort:cpu:1"]
    p = profile_graph(graph, names, policy=QUICK, rounds=1, copy_sizes=(4096, 1 << 20), per_value=2, progress=False)
    for d in names:
        assert set(p.compute[d]) == {o.id for o in graph.ops}  # no node left out: each ran alone
        assert all(c.time_s > 0 for c in p.compute[d].values())
    link = p.copy["ort:cpu:0->ort:cpu:1"]
    assert link.bytes_per_s > 0 and len(link.per_value) == 2
    assert p.devices["ort:cpu:0"].kind == "ort"
    path = save_profile(p, tmp_path / "p.json")
    check_profile(load_profile(path, graph, names), graph, names)
    # another onnxruntime measured it: stale, and the error says what differs
    data = json.loads(path.read_text())
    info = data["devices"]["ort:cpu:0"]
    info["fingerprint"] = "0" * 24
    info["fingerprint_parts"]["onnxruntime"] = "1.0.0"
    path.write_text(json.dumps(data))
    with pytest.raises(ProfileError, match=r"onnxruntime: '1.0.0' -> '[0-9.]+'") as e:
        load_profile(path, graph, names)
    assert e.value.device == "ort:cpu:0"


def test_single_node_sessions_keep_nodes_and_bind_inputs(graph):
    """A node's session runs with optimisations off, its inputs bound as OrtValues on the device."""
    d = get_device("ort:cpu")
    conv = next(o for o in graph.ops if o.call["op_type"] == "Conv")
    call = d.single_node(graph, conv)
    session, io, _ = call.keep
    call()
    assert len(io.get_outputs()) == len(conv.outputs)
    assert session.get_session_options().graph_optimization_level == ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    assert [i.name for i in session.get_inputs()] == [conv.inputs[0]]  # the weights are initializers


def test_copies_only_between_ort_devices():
    a, b = get_device("ort:cpu:0"), get_device("ort:cpu:1")
    assert a.copy_seconds(b, 1 << 20, outgoing=True) > 0
    assert a.copy_seconds(get_device("cpu"), 1 << 20, outgoing=True) is None
    with pytest.raises(DeviceError, match="neither the ort nor the cpu plugin can time a copy"):
        from xsched.profiling.measure import copy_seconds

        copy_seconds(a, get_device("cpu"), 1024)


@pytest.mark.gpu
def test_cuda_provider_profiles_and_copies(graph):
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        pytest.skip("onnxruntime without the CUDA provider (pip install onnxruntime-gpu)")
    gpu, cpu = get_device("ort:cuda:0"), get_device("ort:cpu")
    assert not gpu.is_host and not gpu.params_as_initializers and gpu.memory_bytes > 0
    p = profile_graph(graph, ["ort:cuda:0", "ort:cpu"], policy=QUICK, rounds=1, progress=False)
    assert set(p.compute["ort:cuda:0"]) | set(p.extra.get("unsupported", {}).get("ort:cuda:0", {})) == {
        o.id for o in graph.ops
    }
    assert p.copy["ort:cpu->ort:cuda:0"].bytes_per_s > 0 and p.copy["ort:cuda:0->ort:cpu"].bytes_per_s > 0
    x = gpu.put(__import__("numpy").arange(8, dtype="float32"))
    assert x.device_name().lower() == "cuda"
    assert list(gpu.transfer(x, cpu).numpy()) == list(range(8))
    assert dataclasses.asdict(p.devices["ort:cuda:0"])["kind"] == "ort"
