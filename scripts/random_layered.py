"""A seeded generator of random layered DAGs in the networkx node-link dialect of the Moccasin benchmark graphs.

The rules follow the random layered family of "Neural Topological Ordering for Computation Graphs" (NeurIPS 2022,
Appendix A) as seen in the two published graphs (benchmarks/graphs/random_layered_n{100,250}.json; the paper's
text is not in this repository, so the parameters below are fitted to those graphs' statistics): one source and
one sink of duration 0; the other nodes spread over about 20 + n / 100 layers; every node reads at least one node
of the layer just before it, plus a few more predecessors, mostly from that layer and now and then from an earlier
one (the long skip edges); nodes no one reads feed the sink; durations uniform in [1, 1000]; output sizes multiples
of 10 around 2,000 with a long tail; the mean in-degree grows with n (2.4 at n = 100, 3.8 at 250, 4.9 at 500 in the
paper's graphs).

    python scripts/random_layered.py 500 --seed 0 -o /tmp/random_layered_n500.json
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from pathlib import Path
from typing import Any

SKIP_SHARE = 0.15  # share of the extra predecessors taken from an earlier layer than the one just before


def mean_in_degree(n: int) -> float:
    """The published graphs' mean in-degree, interpolated in log n (2.36 at 100, 3.78 at 250, 4.92 at 500)."""
    return max(1.5, 2.36 + 1.6 * math.log2(n / 100))


def random_layered(n: int, seed: int = 0) -> dict[str, Any]:
    """A node-link dict with n nodes (n >= 3): `nodes` (name, duration, out_cost, param_cost) and `links`."""
    if n < 3:
        raise ValueError("a random layered graph needs at least 3 nodes (source, one node, sink)")
    rng = random.Random(seed)
    layers_n = min(n - 2, 20 + n // 100)
    inner = list(range(1, n - 1))
    layer_of = {v: 1 + (k % layers_n) if k < layers_n else rng.randint(1, layers_n) for k, v in enumerate(inner)}
    layers: list[list[int]] = [[0]] + [[] for _ in range(layers_n)]
    for v in inner:
        layers[layer_of[v]].append(v)
    # names follow the layers, so the lexicographic order of names is a topological order
    flat = [v for layer in layers for v in layer] + [n - 1]
    rename = {v: k for k, v in enumerate(flat)}
    extra_mean = max(mean_in_degree(n) - 1.0, 0.0)
    edges: set[tuple[int, int]] = set()
    for li in range(1, layers_n + 1):
        for v in layers[li]:
            edges.add((rng.choice(layers[li - 1]), v))
            for _ in range(rng.randint(0, round(2 * extra_mean))):
                src_layer = li - 1 if li == 1 or rng.random() > SKIP_SHARE else rng.randint(0, li - 2)
                edges.add((rng.choice(layers[src_layer]), v))
    has_succ = {a for a, _ in edges}
    for v in inner:
        if v not in has_succ:
            edges.add((v, n - 1))
    nodes = []
    for v in flat:
        end = v in (0, n - 1)
        size = 10 * max(2, round(rng.lognormvariate(math.log(160), 0.6)))
        nodes.append(
            {"out_cost": size, "param_cost": 0, "duration": 0 if end else rng.randint(1, 1000), "name": rename[v]}
        )
    nodes.sort(key=lambda x: x["name"])
    links = [{"0": rename[a], "1": rename[b]} for a, b in sorted(edges, key=lambda e: (rename[e[0]], rename[e[1]]))]
    return {"directed": True, "multigraph": False, "graph": {}, "nodes": nodes, "links": links}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("n", type=int)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("-o", "--out", type=Path, required=True)
    args = p.parse_args(argv)
    args.out.write_text(json.dumps(random_layered(args.n, args.seed)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
