"""Import of the external networkx bench graphs."""

from __future__ import annotations

import json

import pytest
from conftest import BENCH

from xsched.errors import GraphError
from xsched.importers import import_networkx
from xsched.simulate import simulate
from xsched.solve.reference import eager_plan


def test_random_layered_n100_sizes_and_published_peak():
    g, p = import_networkx(BENCH / "random_layered_n100.json")
    assert len(g.ops) == 100
    assert sum(len(o.inputs) for o in g.ops) == 236
    # The README's peak without rematerialization under the lexicographic topological order.
    plan = eager_plan(g, "bench", p)
    assert simulate(g, plan, p).peak_bytes["bench"] == 50_590


def test_random_layered_n250_published_peak():
    g, p = import_networkx(BENCH / "random_layered_n250.json")
    assert (len(g.ops), sum(len(o.inputs) for o in g.ops)) == (250, 944)
    assert simulate(g, eager_plan(g, "bench", p), p).peak_bytes["bench"] == 135_910


@pytest.mark.parametrize("path", sorted(BENCH.glob("checkmate_*.json")), ids=lambda p: p.stem)
def test_checkmate_graphs(path):
    g, p = import_networkx(path)
    raw = json.loads(path.read_text())
    assert len(g.ops) == len(raw["nodes"])
    assert sum(len(o.inputs) for o in g.ops) == len(raw["links"])
    assert {o.phase for o in g.ops} == {"fwd", "bwd"}
    assert sum(c.time_s for c in p.compute["bench"].values()) == sum(n["cost_cpu"] for n in raw["nodes"])
    r = simulate(g, eager_plan(g, "bench", p), p)
    assert r.time_s == sum(n["cost_cpu"] for n in raw["nodes"])


def test_deterministic_order():
    a, _ = import_networkx(BENCH / "random_layered_n100.json")
    b, _ = import_networkx(BENCH / "random_layered_n100.json")
    assert [o.id for o in a.ops] == [o.id for o in b.ops]
    assert a.fingerprint == b.fingerprint


def test_unknown_dialect_and_bad_link(tmp_path):
    p = tmp_path / "g.json"
    p.write_text(json.dumps({"nodes": [{"id": 0, "what": 1}], "links": []}))
    with pytest.raises(GraphError, match="dialect"):
        import_networkx(p)
    p.write_text(
        json.dumps({"nodes": [{"id": 0, "cost_cpu": 1, "cost_ram": 2}], "links": [{"source": 0, "target": 7}]})
    )
    with pytest.raises(GraphError, match="unknown node"):
        import_networkx(p)
