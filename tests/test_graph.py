"""Graph IR: validation errors name the offender, JSON round-trips, fingerprints are stable."""

from __future__ import annotations

import json

import pytest
from conftest import chain_graph

from xsched.contracts.graph import Graph, Op, Value
from xsched.contracts.toposort import find_cycle
from xsched.errors import GraphError


def test_json_round_trip_keeps_fingerprint(tmp_path):
    g = chain_graph([10, 20, 30], train=True)
    path = tmp_path / "g.json"
    g.save(path)
    h = Graph.load(path)
    assert h == g
    assert h.fingerprint == g.fingerprint


def test_fingerprint_ignores_name_but_not_sizes():
    g = chain_graph([10, 20])
    renamed = Graph("other", g.values, g.ops, g.outputs)
    assert renamed.fingerprint == g.fingerprint
    bigger = chain_graph([10, 21])
    assert bigger.fingerprint != g.fingerprint


def test_extra_fields_survive_round_trip():
    d = chain_graph([4]).to_dict()
    d["values"][1]["note"] = "kept"
    d["ops"][0]["flops"] = 12
    g = Graph.from_dict(json.loads(json.dumps(d)))
    assert g.value["a0"].extra == {"note": "kept"}
    assert g.to_dict()["ops"][0]["flops"] == 12


def test_unknown_schema():
    d = chain_graph([4]).to_dict()
    d["schema"] = "xsched.graph/99"
    with pytest.raises(GraphError, match="unknown graph schema"):
        Graph.from_dict(d)


def test_dangling_input_names_op_and_value():
    with pytest.raises(GraphError) as e:
        Graph("g", (Value("x", 1, "input"),), (Op("o1", "t", ("nope",), ()),), ())
    assert e.value.op == "o1" and e.value.value == "nope"


def test_dangling_output():
    with pytest.raises(GraphError) as e:
        Graph("g", (Value("x", 1, "input"),), (), ("y",))
    assert e.value.value == "y"


def test_out_of_order_names_op():
    vals = (Value("x", 1, "input"), Value("a", 1), Value("b", 1))
    ops = (Op("o2", "t", ("a",), ("b",)), Op("o1", "t", ("x",), ("a",)))
    with pytest.raises(GraphError, match="out of topological order") as e:
        Graph("g", vals, ops, ())
    assert e.value.op == "o2" and e.value.value == "a"


def test_cycle_is_reported_as_cycle():
    vals = (Value("a", 1), Value("b", 1))
    ops = (Op("o1", "t", ("b",), ("a",)), Op("o2", "t", ("a",), ("b",)))
    with pytest.raises(GraphError, match="cycle") as e:
        Graph("g", vals, ops, ())
    assert e.value.op in {"o1", "o2"}


def test_find_cycle_on_dag_is_empty():
    g = chain_graph([1, 2, 3], train=True)
    assert find_cycle(g.ops, g.producer) == []


def test_value_without_producer_must_be_an_input_kind():
    with pytest.raises(GraphError, match="no producer") as e:
        Graph("g", (Value("a", 1, "activation"),), (), ())
    assert e.value.value == "a"


def test_produced_twice():
    vals = (Value("x", 1, "input"), Value("a", 1))
    ops = (Op("o1", "t", ("x",), ("a",)), Op("o2", "t", ("x",), ("a",)))
    with pytest.raises(GraphError, match="produced by both"):
        Graph("g", vals, ops, ())


def test_bad_phase_and_negative_bytes():
    with pytest.raises(GraphError, match="phase"):
        Graph("g", (Value("x", 1, "input"), Value("a", 1)), (Op("o", "t", ("x",), ("a",), "sideways"),), ())
    with pytest.raises(GraphError, match="non-negative"):
        Graph("g", (Value("x", -1, "input"),), (), ())


def test_corrupt_file(tmp_path):
    p = tmp_path / "g.json"
    p.write_text("{not json")
    with pytest.raises(GraphError, match="cannot read"):
        Graph.load(p)


def test_lookups():
    g = chain_graph([1, 2], train=True)
    assert g.inputs == ("x",)
    assert g.producer["a1"] == "f1"
    assert g.consumers["a0"] == ("f1", "b1")
    assert g.op_bytes("f1") == 1 + 2
