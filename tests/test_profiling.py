"""The profiling loop on a captured graph, the profile store (round trip, mismatch, corruption, atomic save), the CLI."""

from __future__ import annotations

import importlib.util
import json
import os
import re

import pytest
import torch

import xsched.files as files
import xsched.profiling.store as prof
from xsched.contracts.profile import Profile
from xsched.devices import Policy, get_device
from xsched.devices.base import Device, Measurement
from xsched.errors import PlanError, ProfileError
from xsched.profiling.measure import profile_graph, signature_groups
from xsched.profiling.store import check_profile, load_profile, save_profile
from xsched.simulate import simulate
from xsched.solve.reference import eager_plan

FAST = {
    "policy": Policy(warmup=1, min_reps=2, max_reps=3, max_time_s=0.01, min_sample_s=1e-5),
    "rounds": 1,
    "copy_sizes": (4096, 65536, 1 << 20),
    "per_value": 2,
    "progress": False,
}
DEVICES = ["cpu", "cpu:threads=1", "sim:h100", "sim:h100#1"]


class Mlp(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = torch.nn.Linear(16, 32), torch.nn.Linear(32, 32), torch.nn.Linear(32, 4)

    def forward(self, x):
        return self.c(torch.relu(self.b(torch.relu(self.a(x)))))


@pytest.fixture(scope="module")
def graph():
    from xsched.capture.torch import capture

    torch.manual_seed(0)
    return capture(Mlp(), (torch.randn(8, 16),))


@pytest.fixture(scope="module")
def profile(graph):
    return profile_graph(graph, DEVICES, **FAST)


def test_every_op_has_a_cost_on_every_device(graph, profile):
    for d in DEVICES:
        assert set(profile.compute[d]) == {o.id for o in graph.ops}, d
        assert all(c.time_s > 0 and c.energy_j >= 0 for c in profile.compute[d].values())
    assert profile.energy_source["sim:h100"] == "model" and profile.energy_source["cpu"] in ("rapl", "model")
    assert profile.devices["sim:h100"].fingerprint == profile.devices["sim:h100#1"].fingerprint
    addmm = next(
        o for o in graph.ops if o.target == "aten.addmm.default" and graph.value[o.outputs[0]].shape == (8, 32)
    )
    k = graph.value[addmm.inputs[1]].shape[1]
    assert profile.extra["flops"][addmm.id] == 2 * 8 * 32 * k


def test_copy_links_for_every_ordered_pair(profile):
    assert set(profile.copy) == {f"{a}->{b}" for a in DEVICES for b in DEVICES if a != b}
    for key, link in profile.copy.items():
        assert link.bytes_per_s > 0 and link.latency_s >= 0, key
    host_gpu = profile.extra["links"]["cpu->sim:h100"]
    assert host_gpu["pinned"]["bytes_per_s"] == pytest.approx(64e9) and host_gpu["pageable"][
        "bytes_per_s"
    ] == pytest.approx(25e9)
    assert "pageable" not in profile.extra["links"]["cpu->cpu:threads=1"]  # memcpy between CPUs: one kind of memory
    assert profile.link("sim:h100", "sim:h100#1").bytes_per_s == pytest.approx(450e9)  # NVLink between instances
    assert len(profile.link("cpu", "cpu:threads=1").per_value) == 2  # measured links time their largest values
    assert profile.link("sim:h100", "sim:h100#1").per_value == {}  # a modelled link is exact already


def test_same_signature_measured_once(graph, monkeypatch):
    groups = signature_groups(graph)
    assert len(groups) < len(graph.ops)  # relu forward twice, threshold_backward twice, ...
    calls = []

    class Counting(Device):
        kind = "counting"
        memory_bytes = 1
        description = "counts"

        def fingerprint_parts(self):
            return {}

        def measure_op(self, graph, op, policy=None):
            calls.append(op.id)
            return Measurement(1e-3, 0.0, "model")

    p = profile_graph(graph, [Counting("counting")], **{**FAST, "rounds": 3})
    assert len(calls) == 3 * len(groups) and set(p.compute["counting"]) == {o.id for o in graph.ops}


def test_ops_left_by_the_time_cap_are_modelled_and_listed(graph):
    """A real device with no time at all: the ops get the fallback costs, listed, and the profile plans as any."""
    p = profile_graph(graph, ["cpu:threads=1"], **{**FAST, "max_total_s": 0.0})
    ops = {o.id for o in graph.ops}
    assert set(p.compute["cpu:threads=1"]) == ops and set(p.extra["modelled_ops"]["cpu:threads=1"]) == ops
    assert "max_total_s" in p.profiling["fallback"] and "model" in p.energy_source["cpu:threads=1"]
    assert simulate(graph, eager_plan(graph, "cpu:threads=1"), p).time_s > 0


def test_each_round_hands_the_device_all_ops_in_graph_order(graph):
    rounds = []

    class Batch(Device):
        kind = "batch"
        memory_bytes = 1
        description = "measures a round at once"

        def fingerprint_parts(self):
            return {}

        def measure_op(self, graph, op, policy=None):
            raise AssertionError("profile_graph should call measure_ops")

        def measure_ops(self, graph, ops, policy=None):
            rounds.append([o.id for o in ops])
            return [
                "no vector unit" if o.target == "aten.relu.default" else Measurement(1e-3, 0.0, "model") for o in ops
            ]

    p = profile_graph(graph, [Batch("batch")], **{**FAST, "rounds": 2})
    order = [o.id for o in graph.ops]
    assert len(rounds) == 2 and rounds[0] == sorted(rounds[0], key=order.index)
    assert len(rounds[0]) == len(signature_groups(graph))
    relus = {o.id for o in graph.ops if o.target == "aten.relu.default"}
    assert relus and set(p.extra["unsupported"]["batch"]) == relus and not relus & set(p.compute["batch"])
    assert not {o for ids in rounds[1:] for o in ids} & relus  # an op found unrunnable is not asked for again


def test_ops_a_device_cannot_run_are_left_out(graph):
    class NoMm(Device):
        kind = "nomm"
        memory_bytes = 1
        description = "no matmuls"

        def fingerprint_parts(self):
            return {}

        def measure_op(self, graph, op, policy=None):
            if "mm" in op.target:
                raise RuntimeError("no matmul unit")
            return Measurement(1e-4, 0.0, "model")

    p = profile_graph(graph, [NoMm("nomm")], **FAST)
    mms = {o.id for o in graph.ops if "mm" in o.target}
    assert mms and not mms & set(p.compute["nomm"]) and set(p.extra["unsupported"]["nomm"]) == mms
    with pytest.raises(PlanError, match="cannot run on nomm"):
        simulate(graph, eager_plan(graph, "nomm"), p)


def test_eager_plan_time_is_the_sum_of_op_times(graph, profile):
    for d in ("cpu", "sim:h100"):
        res = simulate(graph, eager_plan(graph, d), profile)
        assert res.time_s == pytest.approx(sum(c.time_s for c in profile.compute[d].values()))


def test_duplicate_devices_are_an_error(graph):
    with pytest.raises(ProfileError, match="distinct devices"):
        profile_graph(graph, ["sim:t4", "sim:t4"], **FAST)


# ---- the store ----
def test_round_trip(tmp_path, graph, profile):
    path = save_profile(profile, tmp_path / "p.json")
    back = load_profile(path, graph)
    assert back.to_dict() == profile.to_dict()
    assert back.extra["torch_version"] == torch.__version__ and back.graph == graph.fingerprint
    assert json.loads(path.read_text())["schema"] == "xsched.profile/1"


def _edited(tmp_path, profile, edit) -> str:
    d = profile.to_dict()
    edit(d)
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(d))
    return str(path)


def test_other_graph_is_an_error(tmp_path, graph, profile):
    from xsched.capture.torch import capture

    other = capture(torch.nn.Linear(16, 4), (torch.randn(8, 16),))
    save_profile(profile, tmp_path / "p.json")
    with pytest.raises(
        ProfileError, match=f"profile is for graph {graph.fingerprint}.*not this graph {other.fingerprint}"
    ):
        load_profile(tmp_path / "p.json", other)


def test_other_device_fingerprint_names_what_differs(tmp_path, graph, profile):
    def edit(d):
        d["devices"]["cpu"]["fingerprint"] = "0" * 24
        d["devices"]["cpu"]["fingerprint_parts"]["brand"] = "Some Other CPU"

    with pytest.raises(ProfileError, match="brand: 'Some Other CPU' -> ") as e:
        load_profile(_edited(tmp_path, profile, edit), graph)
    assert e.value.device == "cpu"
    with pytest.raises(ProfileError, match="no costs for device cuda:3"):
        load_profile(tmp_path / "edited.json", graph, devices=["cuda:3"])
    # planning elsewhere: the graph must match, the machine need not
    assert load_profile(tmp_path / "edited.json", graph, check_machine=False).devices["cpu"].fingerprint == "0" * 24


def test_other_torch_version_is_an_error(tmp_path, graph, profile):
    path = _edited(tmp_path, profile, lambda d: d.update(torch_version="1.0.0"))
    with pytest.raises(ProfileError, match=re.escape(f"measured with torch 1.0.0, this is torch {torch.__version__}")):
        load_profile(path, graph)


def test_reprofile_replaces_a_stale_profile(tmp_path, graph, profile):
    path = _edited(tmp_path, profile, lambda d: d.update(torch_version="1.0.0"))
    fresh = load_profile(path, graph, devices=["sim:t4", "cpu:threads=1"], reprofile=True, **FAST)
    assert set(fresh.devices) == {"sim:t4", "cpu:threads=1"}
    check_profile(load_profile(path), graph)  # saved, and valid now
    missing = tmp_path / "none.json"
    assert set(load_profile(missing, graph, ["sim:l4"], reprofile=True, **FAST).devices) == {"sim:l4"}
    with pytest.raises(ProfileError, match="without knowing the devices"):
        load_profile(tmp_path / "none2.json", graph, reprofile=True)


@pytest.mark.parametrize(
    "corrupt,match",
    [
        (lambda t: t[: len(t) // 2], "corrupt or unreadable"),  # truncated
        (lambda t: "{not json", "corrupt or unreadable"),
        (lambda t: "\xff\xfe garbage", "corrupt or unreadable"),
        (lambda t: t.replace('"xsched.profile/1"', '"xsched.profile/9"'), "unknown profile schema"),
        (lambda t: json.dumps({k: v for k, v in json.loads(t).items() if k != "compute"}), "malformed profile JSON"),
        (lambda t: json.dumps([1, 2]), "unknown profile schema"),
        (lambda t: t.replace('"time_s": ', '"time_s": -', 1), "finite and non-negative"),
        (lambda t: t.replace('"bytes_per_s": ', '"bytes_per_s": -', 1), "bandwidth > 0"),
    ],
)
def test_corrupt_files_are_clear_errors(tmp_path, graph, profile, corrupt, match):
    path = save_profile(profile, tmp_path / "p.json")
    path.write_text(corrupt(path.read_text()))
    with pytest.raises(ProfileError, match=match):
        load_profile(path, graph)


def test_missing_file_is_an_error(tmp_path, graph):
    with pytest.raises(ProfileError, match="no profile file"):
        load_profile(tmp_path / "nope.json", graph)


def test_interrupted_save_loses_nothing(tmp_path, graph, profile, monkeypatch):
    path = save_profile(profile, tmp_path / "p.json")
    before = path.read_bytes()
    changed = Profile(profile.graph, profile.devices, {}, {}, {}, {"torch_version": torch.__version__})

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(files.os, "replace", interrupted)  # the atomic write save_profile goes through
    with pytest.raises(KeyboardInterrupt):
        save_profile(changed, path)
    assert path.read_bytes() == before and os.listdir(tmp_path) == ["p.json"]  # no temp file left behind


# ---- CLI ----
def test_cli_profile_and_devices(tmp_path, graph, capsys):
    from xsched.cli import main

    gpath = tmp_path / "g.json"
    graph.save(gpath)
    out = tmp_path / "prof.json"
    argv = ["profile", str(gpath), "--devices", "sim:h100,cpu:threads=1", "-o", str(out), "--reps", "3"]
    assert main([*argv, "--max-time", "0.5", "--quiet"]) == 0
    p = load_profile(out, graph)
    assert set(p.devices) == {"sim:h100", "cpu:threads=1"}
    assert "sim:h100->cpu:threads=1" in capsys.readouterr().out
    assert main(["devices"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("cpu") and "sim:h100-sxm" in text
    assert main(["devices", "--json", "--no-sim"]) == 0
    kinds = [r["kind"] for r in json.loads(capsys.readouterr().out)]
    ort = importlib.util.find_spec("onnxruntime") is not None  # its providers are devices too (xsched.devices.ort)
    assert [k for k in kinds if k != "ort"] == ["cpu"] + ["cuda"] * torch.cuda.device_count()
    assert ("ort" in kinds) == ort


def test_default_profile_path(graph):
    path = prof.default_profile_path(graph, ["cpu:threads=4", "sim:h100#1"])
    assert path.parent.name == "profiles" and graph.fingerprint[:12] in path.name and ":" not in path.name
    assert get_device("sim:h100#1").name == "sim:h100#1"
