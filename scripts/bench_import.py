"""Import every external bench graph and print its size and eager peak beside the published peak."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from xsched.importers import import_networkx
from xsched.simulate import simulate
from xsched.solve.reference import eager_plan

# Peaks without rematerialization under the lexicographic topological order (benchmarks/graphs/README.md).
PUBLISHED_PEAK = {"random_layered_n100": 50_590, "random_layered_n250": 135_910}
DEFAULT_DIR = Path(__file__).resolve().parents[1] / "benchmarks" / "graphs"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--dir", type=Path, default=DEFAULT_DIR)
    args = ap.parse_args()
    print("| graph | ops | input links | fwd / bwd ops | eager peak (B) | published peak | import + simulate (s) |")
    print("|---|---|---|---|---|---|---|")
    for path in sorted(args.dir.glob("*.json")):
        t0 = time.perf_counter()
        g, p = import_networkx(path)
        r = simulate(g, eager_plan(g, "bench", p), p)
        dt = time.perf_counter() - t0
        fwd = sum(o.phase == "fwd" for o in g.ops)
        links = sum(len(o.inputs) for o in g.ops)
        published = PUBLISHED_PEAK.get(path.stem)
        print(
            f"| {path.stem} | {len(g.ops)} | {links} | {fwd} / {len(g.ops) - fwd} | {r.peak_bytes['bench']:,} "
            f"| {f'{published:,}' if published else '-'} | {dt:.3f} |"
        )


if __name__ == "__main__":
    main()
