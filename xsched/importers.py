"""Importers of external graph formats: the networkx node-link graphs of Checkmate and Moccasin."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from xsched.contracts.graph import Graph, Op, Value, read_text
from xsched.contracts.profile import DeviceInfo, OpCost, Profile
from xsched.contracts.toposort import topological_order
from xsched.errors import GraphError

BENCH_DEVICE = "bench"


def import_networkx(path: str | Path) -> tuple[Graph, Profile]:
    """Read a node-link JSON graph into a `Graph` and a `Profile` on the single device "bench".

    Two dialects: Checkmate's (`id`, `cost_cpu`, `cost_ram`, `backward`; links `source`/`target`)
    and Moccasin's random layered graphs (`name`, `duration`, `out_cost`; links `"0"`/`"1"`).
    Each node is an op with one output value of its output size; ops are ordered by the
    lexicographic topological order of the node ids. Nothing must remain at the end (outputs are
    empty), as in those papers: a node's output lives until its last consumer has run.
    """
    try:
        data = json.loads(read_text(path))
        nodes, links = data["nodes"], data["links"]
    except (OSError, json.JSONDecodeError, UnicodeDecodeError, EOFError, KeyError, TypeError) as e:
        raise GraphError(f"cannot read node-link graph {path}: {e}", stage="import") from e
    dialect = _dialect(nodes, path)
    key = "id" if dialect == "checkmate" else "name"
    src_key, dst_key = ("source", "target") if links and "source" in links[0] else ("0", "1")
    by_id: dict[int, Mapping[str, Any]] = {}
    for n in nodes:
        by_id[int(n[key])] = n
    preds: dict[int, list[int]] = {i: [] for i in by_id}
    for link in links:
        a, b = int(link[src_key]), int(link[dst_key])
        if a not in by_id or b not in by_id:
            raise GraphError(f"link {a}->{b} names an unknown node", stage="import", op=f"n{b}")
        preds[b].append(a)
    order = topological_order(
        [str(i) for i in by_id], [(str(a), str(b)) for b, ps in preds.items() for a in ps], key=int
    )
    position = {int(name): k for k, name in enumerate(order)}
    values, ops, times = [], [], {}
    for name in order:
        i = int(name)
        n = by_id[i]
        size = n.get("cost_ram", n.get("out_cost"))
        duration = n.get("cost_cpu", n.get("duration"))
        if size is None or duration is None:
            raise GraphError("node has no output size or duration", stage="import", op=f"n{i}")
        values.append(Value(id=f"v{i}", nbytes=int(size), kind="activation"))
        ops.append(
            Op(
                id=f"n{i}",
                name=str(n.get("name", i)),
                target="bench.node",
                phase="bwd" if n.get("backward") else "fwd",
                inputs=tuple(f"v{p}" for p in sorted(set(preds[i]), key=position.__getitem__)),
                outputs=(f"v{i}",),
            )
        )
        times[f"n{i}"] = OpCost(time_s=float(duration))
    title = str(data.get("graph", {}).get("name") or Path(path).stem)
    graph = Graph(title, tuple(values), tuple(ops), (), {"source": str(Path(path).name), "dialect": dialect})
    profile = Profile(
        graph=graph.fingerprint,
        devices={BENCH_DEVICE: DeviceInfo(kind="bench", fingerprint=f"bench:{Path(path).name}")},
        compute={BENCH_DEVICE: times},
        energy_source={BENCH_DEVICE: "none"},
        extra={"time_unit": "profiled units of the source graph, not seconds"},
    )
    return graph, profile


def _dialect(nodes: list[Mapping[str, Any]], path: str | Path) -> str:
    if not nodes:
        raise GraphError(f"graph {path} has no nodes", stage="import")
    if "cost_cpu" in nodes[0]:
        return "checkmate"
    if "duration" in nodes[0]:
        return "random_layered"
    raise GraphError(f"unknown node-link dialect in {path}: node keys {sorted(nodes[0])}", stage="import")
