"""Dropout captured for a GPU from CPU tensors (xsched/capture/fused_dropout.py): GPT-2 (6 layers, batch 8, T1024,
dropout 0.1) captured on the CPU for the CPU and for CUDA, beside the graph the lent H100 captured from GPU tensors
(benchmarks/gpu/, 2026-11-27): ops, dropout ops, the eager plan's peak and its step on the measured H100 spec's
roofline (modelled), and whether the graph equals the H100's op for op and value for value.

    python scripts/bench_dropout_capture.py
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
from pathlib import Path

from xsched import zoo
from xsched.capture import capture
from xsched.contracts.graph import Graph
from xsched.profiling.measure import profile_graph
from xsched.simulate import simulate
from xsched.solve.reference import eager_peak, eager_plan

ROOT = Path(__file__).resolve().parents[1]
H100 = ROOT / "benchmarks" / "gpu" / "gpt2-full_n_layer6.h100-20261127.graph.json.gz"
SPEC = "sim:h100-measured"
MARKS = ("dropout", "bernoulli", "empty_like")


def shape_of(g: Graph) -> tuple[list, list]:
    return [o.target for o in g.ops], [(v.dtype, v.shape, v.nbytes) for v in g.values]


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args(argv)
    z = zoo.build("gpt2", batch=8, scale="full:n_layer=6")
    h100 = Graph.from_dict(json.loads(gzip.decompress(H100.read_bytes())))
    rows = {
        "captured on the CPU for the CPU": capture(z.model, z.inputs, device_type="cpu"),
        "captured on the CPU for CUDA": capture(z.model, z.inputs, device_type="cuda"),
        "captured on the H100 from GPU tensors (stored)": h100,
    }
    print(f"| graph | ops | dropout ops | eager peak | eager step ({SPEC}, modelled) | = the H100's graph |")
    print("|---|---|---|---|---|---|")
    for label, g in rows.items():
        prof = profile_graph(g, [SPEC], progress=False)
        step = simulate(g, eager_plan(g, SPEC, prof), prof).makespan_s
        marks = collections.Counter(o.target.split(".")[1] for o in g.ops if any(m in o.target for m in MARKS))
        ops = ", ".join(f"{k} {n}" for k, n in sorted(marks.items()))
        same = "yes" if shape_of(g) == shape_of(h100) else "no"
        print(f"| {label} | {len(g.ops)} | {ops} | {eager_peak(g) / 2**30:.3f} GiB | {step * 1e3:.1f} ms | {same} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
