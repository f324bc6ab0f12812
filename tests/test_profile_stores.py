"""Store devices: profiled for their copies only (no op runs there), keyed apart in the profile store, planned on."""

from __future__ import annotations

import pytest
import torch

from xsched.contracts.plan import Compute, Copy, Plan
from xsched.contracts.profile import Profile
from xsched.devices import Policy
from xsched.devices.base import DEFAULT_POLICY, Device, DeviceError, Measurement
from xsched.errors import ProfileError
from xsched.pipeline import plan_profile, profile_path
from xsched.profiling.measure import profile_graph
from xsched.profiling.store import default_profile_path, load_profile, save_profile

FAST = {
    "policy": Policy(warmup=1, min_reps=2, max_reps=3, max_time_s=0.01, min_sample_s=1e-5),
    "rounds": 1,
    "copy_sizes": (4096, 65536, 1 << 20),
    "per_value": 2,
    "progress": False,
}


@pytest.fixture(scope="module")
def graph():
    from xsched.capture.torch import capture

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    return capture(model, (torch.randn(8, 16),))


class Counting(Device):
    """Counts the ops it is asked to measure (measure_ops would turn an exception into 'cannot run here')."""

    kind = "counting"
    memory_bytes = 1 << 30
    description = "counts"

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.measured: list[str] = []

    def fingerprint_parts(self):
        return {}

    def measure_op(self, graph, op, policy=DEFAULT_POLICY):
        self.measured.append(op.id)
        return Measurement(1e-4, 0.0, "model")

    def copy_seconds(self, other, nbytes, *, outgoing, pinned=True):
        return 1e-6 + nbytes / 1e10


def test_a_store_runs_no_op_and_is_linked_both_ways(graph):
    compute, store = Counting("counting:0"), Counting("counting:1")
    p = profile_graph(graph, [compute], stores=[store], **{**FAST, "rounds": 3})
    assert store.measured == [] and len(compute.measured) > 0  # never attempted on the store
    assert p.compute["counting:1"] == {} and p.is_store("counting:1") and not p.is_store("counting:0")
    assert set(p.copy) == {"counting:0->counting:1", "counting:1->counting:0"}
    assert p.stores == ("counting:1",) and p.to_dict()["stores"] == ["counting:1"] and "stores" not in p.extra


def test_logical_cpus_compute_and_store(tmp_path, graph):
    p = profile_graph(graph, ["cpu:0"], stores=["cpu:1"], **FAST)
    ops = {o.id for o in graph.ops}
    assert set(p.compute["cpu:0"]) == ops and p.compute["cpu:1"] == {}
    assert set(p.devices) == {"cpu:0", "cpu:1"} and set(p.copy) == {"cpu:0->cpu:1", "cpu:1->cpu:0"}
    for key, link in p.copy.items():
        assert link.bytes_per_s > 0 and len(link.per_value) == 2, key  # a measured link times the largest values
    back = load_profile(save_profile(p, tmp_path / "p.json"), graph, ["cpu:0", "cpu:1"])
    assert back.stores == ("cpu:1",) and back.is_store("cpu:1") and not back.is_store("cpu:0")


@pytest.mark.parametrize(
    "devices,stores,error,match",
    [
        (["cpu:0"], ["cpu:0"], ProfileError, "cpu:0 is both a compute device and a store"),
        (["cpu:0"], ["nope:1"], DeviceError, "store nope:1: unknown device kind 'nope'"),
        (["cpu:0"], ["cpu:1", "cpu:1"], ProfileError, "distinct devices"),
        ([], ["cpu:1"], ProfileError, "at least one compute device"),
    ],
)
def test_bad_stores_are_one_line_errors(graph, devices, stores, error, match):
    with pytest.raises(error, match=match) as e:
        profile_graph(graph, devices, stores=stores, **FAST)
    assert "\n" not in str(e.value)


def test_stores_key_the_stored_profile(tmp_path, graph, monkeypatch):
    plain, stored = default_profile_path(graph, ["cpu:0"]), default_profile_path(graph, ["cpu:0"], ["cpu:1"])
    assert plain != stored and stored.name.endswith("-cpu-0_store-cpu-1.json")
    assert profile_path(graph, ["cpu:0"], tmp_path, ["cpu:1"]) == tmp_path / stored.name
    # the pipeline (wrap, train): the store named among the devices or not, measured once, then the cached file
    import xsched.pipeline as pipeline

    calls = []

    def counted(*args, **kwargs):
        calls.append(kwargs.get("stores"))
        return profile_graph(*args, **{**kwargs, **{k: v for k, v in FAST.items() if k != "progress"}})

    monkeypatch.setattr(pipeline, "profile_graph", counted)
    p = plan_profile(graph, ["cpu:0", "cpu:1"], "measure", tmp_path, stores=["cpu:1"])
    assert calls == [["cpu:1"]] and p.is_store("cpu:1") and (tmp_path / stored.name).exists()
    again = plan_profile(graph, ["cpu:0"], "measure", tmp_path, stores=["cpu:1"])
    assert calls == [["cpu:1"]] and again.to_dict() == p.to_dict()
    modelled = plan_profile(graph, ["cpu:0", "cpu:1"], "model", stores=["cpu:1"])
    assert modelled.is_store("cpu:1") and set(modelled.copy) == {"cpu:0->cpu:1", "cpu:1->cpu:0"}


def test_a_stale_stored_profile_is_measured_again_with_its_store(tmp_path, graph):
    p = profile_graph(graph, ["cpu:0"], stores=["cpu:1"], **FAST)
    d = p.to_dict()
    d["torch_version"] = "1.0.0"
    path = tmp_path / "stale.json"
    save_profile(Profile.from_dict(d), path)
    fresh = load_profile(path, graph, reprofile=True, **FAST)  # devices and stores from the stale file
    assert fresh.extra["torch_version"] == torch.__version__ and fresh.stores == ("cpu:1",) and fresh.is_store("cpu:1")


def test_cli_profile_with_a_store_then_plan_offload(tmp_path, capsys):
    """`xsched profile --store`, then `xsched plan` with the offload heuristic parking values on the store."""
    from xsched import zoo
    from xsched.capture.torch import capture
    from xsched.cli import main

    z = zoo.build("gpt2", scale="tiny")
    graph = capture(z.model, z.inputs, name="gpt2")
    gpath, ppath, plan_path = tmp_path / "g.json", tmp_path / "p.json", tmp_path / "plan.json"
    graph.save(gpath)
    assert main(["profile", str(gpath), "--devices", "cpu:0", "--store", "cpu:1", "-o", str(ppath), "--reps", "3"]) == 0
    out = capsys.readouterr().out
    assert "1 devices and 1 store" in out and "cpu:1            store: holds values, runs no op" in out
    profile = load_profile(ppath, graph)
    assert profile.is_store("cpu:1") and set(profile.compute["cpu:0"]) == {o.id for o in graph.ops}
    budgets = ["--budget", "cpu:0=80%", "--budget", "cpu:1=64GiB"]
    assert main(["plan", str(gpath), str(ppath), *budgets, "--method", "offload", "-o", str(plan_path)]) == 0
    plan = Plan.load(plan_path)
    assert {s.device for s in plan.steps if isinstance(s, Compute)} == {"cpu:0"}
    assert any(isinstance(s, Copy) and s.dst == "cpu:1" for s in plan.steps)  # parked on the store
