"""The simulated H100 (`sim:h100-measured`, a roofline fitted to one profile) against what the H100 measured, op
class by op class, on the stored graphs and profiles of benchmarks/gpu/ (GPT-2 6 layers, b8, T1024, the loss whole
and in 8 row blocks; 2026-11-27). Nothing runs on a GPU: the measured column is the stored profile.

    python scripts/bench_sim_fidelity.py [--top 20]
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
from collections import defaultdict
from pathlib import Path

from xsched.contracts.graph import Graph
from xsched.contracts.profile import Profile
from xsched.devices import get_device

ROOT = Path(__file__).resolve().parent.parent
GRAPHS = {"loss whole": "gpt2-full_n_layer6", "loss in 8 blocks": "gpt2-full_n_layer6-chunk8"}


def load(stem: str) -> tuple[Graph, Profile]:
    base = ROOT / "benchmarks" / "gpu" / f"{stem}.h100-20261127"
    with gzip.open(f"{base}.graph.json.gz") as f:
        graph = Graph.from_dict(json.load(f))
    with gzip.open(f"{base}.profile.json.gz") as f:
        return graph, Profile.from_dict(json.load(f))


def by_class(graph: Graph, profile: Profile) -> dict[str, tuple[int, float, float]]:
    """op target -> (ops, measured s, modelled s) over one step's ops, each once."""
    sim = get_device("sim:h100-measured")
    rows: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0])
    for op in graph.ops:
        row = rows[op.target]
        row[0] += 1
        row[1] += profile.op_cost(op.id, "cuda:0").time_s
        row[2] += sim.measure_op(graph, op).time_s
    return {t: (int(n), m, s) for t, (n, m, s) in rows.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--top", type=int, default=20, help="op classes shown per graph, by measured time")
    a = ap.parse_args(argv)
    os.chdir(ROOT)  # the measured spec lives in the checkout's devices/
    totals = {}
    for label, stem in GRAPHS.items():
        rows = by_class(*load(stem))
        measured, modelled = sum(r[1] for r in rows.values()), sum(r[2] for r in rows.values())
        totals[label] = (measured, modelled)
        print(
            f"\n{label}: {sum(r[0] for r in rows.values())} ops, sum of op times measured {measured * 1e3:.1f} ms, "
            f"modelled {modelled * 1e3:.1f} ms ({modelled / measured:.3f})"
        )
        print("\n| op | ops | measured ms | modelled ms | modelled / measured |\n|---|---|---|---|---|")
        for target, (n, m, s) in sorted(rows.items(), key=lambda kv: -kv[1][1])[: a.top]:
            print(f"| {target.removeprefix('aten.')} | {n} | {m * 1e3:.2f} | {s * 1e3:.2f} | {s / m:.2f} |")
    (mw, sw), (mb, sb) = totals.values()
    print(f"\nthe loss in 8 blocks against whole, summed op times: measured {mb / mw:.3f}, modelled {sb / sw:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
