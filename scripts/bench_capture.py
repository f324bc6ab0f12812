"""Capture cost of every zoo model: wall time of xsched.capture.torch.capture and the size of the joint graph.

Usage: python scripts/bench_capture.py [--scales tiny,default] [--models gpt2,resnet18]
Prints a Markdown table (one capture per model and scale, after one untimed warm-up capture; building the
model is not timed). "cpu s" is the process CPU time, steadier than wall time on a shared machine. "eager peak" is the simulated peak memory of the eager plan of the captured graph.
"""

from __future__ import annotations

import argparse
import platform
import time

import torch

from xsched import zoo
from xsched.budgets import format_bytes
from xsched.capture import capture
from xsched.solve.reference import eager_peak


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scales", default="tiny,default")
    ap.add_argument("--models", default=",".join(zoo.names()))
    args = ap.parse_args()
    print(
        f"torch {torch.__version__}, {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads\n"
    )
    warm = zoo.build("mlp_mixer", scale="tiny")  # the first capture in a process pays torch's one-time setup
    capture(warm.model, warm.inputs)
    print("| model | scale | params | capture wall s | capture cpu s | ops | values | fwd | loss | bwd | eager peak |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for scale in args.scales.split(","):
        for name in args.models.split(","):
            z = zoo.build(name, scale=scale)
            t0, c0 = time.perf_counter(), time.process_time()
            g = capture(z.model, z.inputs, name=f"{name}-{scale}")
            dt, dc = time.perf_counter() - t0, time.process_time() - c0
            phases = [o.phase for o in g.ops]
            n_params = sum(p.numel() for p in z.model.parameters())
            print(
                f"| {name} | {scale} | {n_params:,} | {dt:.2f} | {dc:.2f} | {len(g.ops)} | {len(g.values)} | "
                f"{phases.count('fwd')} | {phases.count('loss')} | {phases.count('bwd')} | {format_bytes(eager_peak(g))} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
