"""Profiling's time cap, measured: profile one graph with max_total_s at a few caps and print wall time / cap.

    python scripts/bench_profile_cap.py zoo:gpt2 --scale full:n_layer=6 --batch 8 --devices cuda:0 --store cpu \
        --caps 20,40 --uncapped
    python scripts/bench_profile_cap.py zoo:gpt2 --scale small --devices cpu:threads=1 --caps 2,5,10 --uncapped

Each row: the cap, the wall seconds of the whole profile_graph call (device set-up, inputs, warm-up, samples and
copies: what the cap counts; the devices' one-time set-up is printed apart), wall / cap (issue 24 asks at most 1.1), per compute device the ops measured and those
modelled (the fallback for ops the cap left out), and with --uncapped the eager plan's time from the capped profile
against the uncapped one's (what the cap costs in fidelity). The graph is captured on the CPU, or read from a graph
JSON (.json or .json.gz).
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
import time
from collections.abc import Sequence
from typing import Any

from xsched.contracts.graph import Graph
from xsched.devices.base import get_device, split_device_list
from xsched.loaders import load_graph
from xsched.profiling.measure import profile_graph
from xsched.simulate import simulate
from xsched.solve.reference import eager_plan


def read_graph(spec: str, batch: int | None, scale: str) -> Graph:
    if spec.endswith(".json.gz"):
        with gzip.open(spec, "rt") as f:
            return Graph.from_dict(json.load(f))
    return load_graph(spec, batch=batch, scale=scale)


def cap_row(graph: Graph, devices: Sequence[str], stores: Sequence[str], cap: float | None) -> dict[str, Any]:
    """One profile_graph run under `cap` (None: uncapped): its wall seconds and what it measured or modelled."""
    t0 = time.perf_counter()
    p = profile_graph(graph, devices, stores=stores, max_total_s=cap, progress=False)
    wall = time.perf_counter() - t0
    modelled = p.extra.get("modelled_ops", {})
    return {
        "cap_s": cap,
        "wall_s": wall,
        "ratio": wall / cap if cap else None,
        "modelled": {d: len(modelled.get(d, [])) for d in devices},
        "eager_s": {d: simulate(graph, eager_plan(graph, d), p).time_s for d in devices},
    }


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", help="zoo:NAME, file.py:factory, graph.json or graph.json.gz")
    ap.add_argument("--scale", default="default")
    ap.add_argument("--batch", type=int)
    ap.add_argument("--devices", default="cpu:threads=1")
    ap.add_argument("--store", default="", help="comma-separated store devices (copies only), e.g. cpu")
    ap.add_argument("--caps", default="20,40", help="comma-separated max_total_s values")
    ap.add_argument("--uncapped", action="store_true", help="also an uncapped run, the reference for fidelity")
    a = ap.parse_args(argv)
    graph = read_graph(a.model, a.batch, a.scale)
    devices, stores = split_device_list(a.devices), split_device_list(a.store)
    t0 = time.perf_counter()
    for d in [*devices, *stores]:  # once per process (CPU identification, CUDA context): not part of the rows
        get_device(d)
    print(f"device set-up, once per process: {time.perf_counter() - t0:.2f} s")
    print(f"{graph.name}: {len(graph.ops)} ops; devices {', '.join(devices)}; stores {', '.join(stores) or 'none'}")
    rows = [cap_row(graph, devices, stores, float(c)) for c in a.caps.split(",") if c.strip()]
    ref = cap_row(graph, devices, stores, None) if a.uncapped else None
    print("| cap | wall | wall / cap | " + " | ".join(f"{d} modelled ops | {d} eager vs uncapped" for d in devices))
    print("|---|---|---|" + "---|---|" * len(devices))
    for r in [*rows, *([ref] if ref else [])]:
        cells = []
        for d in devices:
            vs = f"{r['eager_s'][d] / ref['eager_s'][d]:.3f}" if ref else "-"
            cells += [f"{r['modelled'][d]}/{len(graph.ops)}", vs]
        cap = f"{r['cap_s']:g} s" if r["cap_s"] is not None else "none"
        ratio = f"{r['ratio']:.3f}" if r["ratio"] is not None else "-"
        print(f"| {cap} | {r['wall_s']:.2f} s | {ratio} | " + " | ".join(cells) + " |")
    worst = max((r["ratio"] for r in rows), default=0.0)
    print(f"worst wall / cap: {worst:.3f} ({'within' if worst <= 1.1 else 'OVER'} 10%)")
    return 0 if worst <= 1.1 else 1


if __name__ == "__main__":
    sys.exit(main())
