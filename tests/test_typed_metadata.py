"""Typed metadata (issue 33): a graph's training roles and a profile's stores, modelled flag and profiling record are
validated fields; files written when they lived in `extra` still load into them, and keep their fingerprint."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from xsched.contracts.graph import Graph, Op, Value
from xsched.contracts.profile import DeviceInfo, OpCost, Profile
from xsched.errors import GraphError, ProfileError

GPU = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu"


def read(name: str) -> dict:
    with gzip.open(GPU / name, "rt") as f:
        return json.load(f)


def small(**roles) -> Graph:
    values = (Value("x", 4, "input"), Value("w", 4, "param", name="w"), Value("y", 4), Value("gw", 4, grad_of="w"))
    ops = (Op("f", "t", ("x", "w"), ("y",)), Op("b", "t", ("y", "x"), ("gw",), "bwd"))
    return Graph("small", values, ops, ("y", "gw"), **roles)


def test_an_old_graph_file_loads_its_roles_into_the_fields_and_keeps_its_fingerprint() -> None:
    """The GPT-2 graph was written with the roles in `extra`; its profile names the graph by fingerprint."""
    old = read("gpt2-full_n_layer6.graph.json.gz")
    assert {"forward_outputs", "grads", "input_grads", "buffer_updates"} <= set(old["extra"])
    g = Graph.from_dict(old)
    assert g.fingerprint == read("gpt2-full_n_layer6.h200.profile.json.gz")["graph"]
    assert [r["ref"] for r in g.forward_outputs] == [r["ref"] for r in old["extra"]["forward_outputs"]]
    assert g.grads == old["extra"]["grads"] and len(g.grads) == 76 and g.buffer_updates == {}
    assert not {"forward_outputs", "grads", "input_grads", "buffer_updates"} & set(g.extra)
    new = g.to_dict()  # the writer's form: top-level keys, none left in extra
    assert new["grads"] == old["extra"]["grads"] and "grads" not in new["extra"]
    again = Graph.from_dict(json.loads(json.dumps(new)))
    assert again == g and again.fingerprint == g.fingerprint


def test_input_grads_keys_are_positions_in_memory_and_strings_in_json() -> None:
    g = small(forward_outputs=({"ref": "y"}, 3), input_grads={0: {"ref": "gw"}})
    d = json.loads(json.dumps(g.to_dict()))
    assert d["input_grads"] == {"0": {"ref": "gw"}} and d["forward_outputs"] == [{"ref": "y"}, 3]
    back = Graph.from_dict(d)
    assert back.input_grads == {0: {"ref": "gw"}} and back.forward_outputs == ({"ref": "y"}, 3)
    assert back.fingerprint == g.fingerprint
    assert small().fingerprint != g.fingerprint  # the roles are part of what the fingerprint covers
    assert small().to_dict().keys().isdisjoint({"forward_outputs", "grads", "input_grads", "buffer_updates"})


@pytest.mark.parametrize(
    "roles,match,value",
    [
        ({"forward_outputs": ({"ref": "nope"},)}, r"forward_outputs\[0\] names unknown value 'nope'", "nope"),
        ({"grads": {"w": {"ref": "ghost"}}}, r"grads\['w'\] names unknown value 'ghost'", "ghost"),
        ({"buffer_updates": {"bn.mean": {"ref": "zz"}}}, r"buffer_updates\['bn.mean'\] names unknown", "zz"),
        ({"input_grads": {"0": {"ref": "gw"}}}, r"input_grads key must be an input position .* got '0'", None),
        ({"input_grads": {-1: {"ref": "gw"}}}, r"input_grads key must be an input position .* got -1", None),
        ({"grads": {"w": "gw"}}, r"grads\['w'\] must be a ref .* got 'gw'", None),
        ({"grads": [("w", {"ref": "gw"})]}, r"grads must be a mapping, got list", None),
        ({"forward_outputs": [{"ref": "y"}]}, r"forward_outputs must be a tuple, got list", None),
    ],
)
def test_a_bad_role_is_one_error_naming_it(roles, match, value) -> None:
    with pytest.raises(GraphError, match=match) as e:
        small(**roles)
    assert e.value.value == value


def test_a_bad_role_in_an_old_files_extra_is_refused_on_load() -> None:
    d = small(forward_outputs=({"ref": "y"},)).to_dict()
    d["extra"] = {"forward_outputs": [{"ref": "gone"}]}
    del d["forward_outputs"]
    with pytest.raises(GraphError, match=r"forward_outputs\[0\] names unknown value 'gone'"):
        Graph.from_dict(d)


def test_an_old_profile_file_loads_stores_modelled_and_profiling_into_the_fields() -> None:
    old = read("gpt2-full_n_layer6.h100.profile.json.gz")
    p = Profile.from_dict(old)
    assert p.stores == ("cpu",) and p.modelled is False and p.profiling == old["profiling"]
    assert not {"stores", "modelled", "profiling"} & set(p.extra)
    d = json.loads(json.dumps(p.to_dict()))
    assert d["stores"] == ["cpu"] and d["profiling"] == old["profiling"] and "modelled" not in d
    assert Profile.from_dict(d) == p
    modelled = Profile.from_dict({**old, "modelled": True})
    assert modelled.modelled and modelled.to_dict()["modelled"] is True


def base_profile(**fields) -> Profile:
    devices = {"gpu": DeviceInfo("cuda"), "host": DeviceInfo("cpu")}
    return Profile("fp", devices, {"gpu": {"f": OpCost(1.0)}, "host": {}}, **fields)


@pytest.mark.parametrize(
    "fields,match,device",
    [
        ({"stores": ("disk",)}, r"store 'disk' is not among the profile's devices", "disk"),
        ({"stores": ("gpu",)}, r"store 'gpu' has compute costs", "gpu"),
        ({"modelled": "yes"}, r"'modelled' must be true or false, got 'yes'", None),
        ({"profiling": {"wall_s": -1.0}}, r"profiling.wall_s must be a finite non-negative .* got -1.0", None),
        ({"profiling": [1, 2]}, r"'profiling' must be a mapping, got \[1, 2\]", None),
        ({"stores": "host"}, r"'stores' must be a list of device names, got 'host'", None),
    ],
)
def test_a_bad_profile_field_is_one_error_naming_it(fields, match, device) -> None:
    assert base_profile(stores=("host",)).stores == ("host",)
    with pytest.raises(ProfileError, match=match) as e:
        base_profile(**fields)
    assert e.value.device == device
    as_json = {k: list(v) if isinstance(v, tuple) else v for k, v in fields.items()}
    with pytest.raises(ProfileError, match=match):  # the same from a file's JSON
        Profile.from_dict({**base_profile().to_dict(), **as_json})


def test_gzipped_contract_files_load_and_a_corrupt_one_is_one_error(tmp_path) -> None:
    g = Graph.load(GPU / "gpt2-full_n_layer6.graph.json.gz")
    p = Profile.load(GPU / "gpt2-full_n_layer6.h100.profile.json.gz")
    p.check_graph(g.fingerprint)
    bad = tmp_path / "x.graph.json.gz"
    bad.write_bytes(gzip.compress(b"\xff\xfe not json"))
    with pytest.raises(GraphError, match="cannot read graph file"):
        Graph.load(bad)
    bad.write_bytes(b"not gzip at all")
    with pytest.raises(ProfileError, match="cannot read profile file"):
        Profile.load(bad)
