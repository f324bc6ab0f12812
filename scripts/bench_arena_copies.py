"""Planned addresses on the CPU against the executor's default: which ops of GPT-2 write into their arena slot
through an `out=` kernel and which run through a composite `out=` (the functional op into a fresh tensor, then copied
into the slot), the copies and bytes a step then adds (counted by the profiler: aten::copy_ calls and the bytes they
write, arena run less default run), and the step time of both, interleaved in one run. No GPU.

    python scripts/bench_arena_copies.py --scale default --batch 8 --iters 10
    python scripts/bench_arena_copies.py --stored /path/gpt2-full_n_layer_6   # a GPU run's graph: the counts only
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import Counter

import torch

from xsched import zoo
from xsched.allocator.placement import ArenaPlan, arena_kernel, composite_out
from xsched.capture.torch import bind_inputs, capture
from xsched.contracts.graph import Graph
from xsched.contracts.plan import Compute
from xsched.contracts.profile import Profile
from xsched.execute.executor import Executor
from xsched.solve.reference import eager_plan

MiB = 1 << 20


def kernel_counts(graph, plan, profile=None) -> tuple[dict[str, Counter], ArenaPlan]:
    """Per op target, the computes of the plan by how planned addresses run them, and their outputs' bytes: "kernel"
    (an `out=` kernel writes the slot), "rewrite" (our rewrite of a composite `out=` writes the slot,
    placement._rewrites), "composite" (PyTorch's generated `out=`: the functional op, then a copy into the slot, as
    every composite ran before this branch), "composite outside" (run as without planned addresses, where ArenaPlan
    found that the smaller peak) and "outside" (not placed for another reason)."""
    ap = ArenaPlan(graph, plan, handed=False, profile=profile)
    got: dict[str, Counter] = {k: Counter() for k in ("kernel", "rewrite", "composite", "composite outside", "outside")}
    for i, s in enumerate(plan.steps):
        if not isinstance(s, Compute):
            continue
        op = graph.op[s.op]
        composite = composite_out(op.target)
        if i in ap.compute_steps:
            kind = ("rewrite" if arena_kernel(op.target) is not None else "composite") if composite else "kernel"
        else:
            kind = "composite outside" if composite else "outside"
        got[kind][op.target] += 1
        got[kind][op.target + " bytes"] += sum(graph.value[v].nbytes for v in op.outputs)
    return got, ap


def print_counts(got: dict[str, Counter], ap: ArenaPlan, device: str) -> None:
    a = ap.addresses
    print("| how the arena runs it | op | computes | output MiB |")
    print("|---|---|---|---|")
    for kind, c in got.items():
        for t in sorted((t for t in c if not t.endswith(" bytes")), key=lambda t: -c[t + " bytes"]):
            print(f"| {kind} | {t} | {c[t]} | {c[t + ' bytes'] / MiB:,.1f} |")
    print(
        f"{device}: arena {a.arena_bytes.get(device, 0) / MiB:,.1f} MiB (bound {a.lower_bound.get(device, 0) / MiB:,.1f}),"
        f" most outside at once {a.outside_peak.get(device, 0) / MiB:,.1f} MiB (workspaces and temporaries included),"
        f" composites placed: {ap.composites}"
    )


def stored(prefix: str) -> None:
    """The counts for a stored graph and profile (PREFIX.graph.json.gz, PREFIX.profile.json.gz), eager on cuda:0."""
    graph = Graph.load(prefix + ".graph.json.gz")
    profile = Profile.load(prefix + ".profile.json.gz")
    plan = eager_plan(graph, "cuda:0", profile)
    print(f"{graph.name}: {len(graph.ops)} ops, eager plan on cuda:0, planned addresses (whole steps)")
    print_counts(*kernel_counts(graph, plan, profile), "cuda:0")


def copies(ex: Executor, env) -> tuple[int, int]:
    """aten::copy_ calls in one step and the bytes they write (their destination's shape and dtype)."""
    st = ex.start(env)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        ex.run(st)
    calls = written = 0
    for e in prof.events():
        if e.name == "aten::copy_" and e.input_shapes:
            calls += 1
            numel = 1
            for s in e.input_shapes[0]:
                numel *= s
            written += numel * torch.empty((), dtype=getattr(torch, _dtype(e.input_dtypes[0]))).element_size()
    return calls, written


def _dtype(name: str) -> str:
    return {"float": "float32", "double": "float64", "long int": "int64", "bool": "bool", "int": "int32"}.get(
        name, "float32"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scale", default="default")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--stored", help="PREFIX of a stored graph and profile: print its counts (eager, cuda:0) only")
    a = ap.parse_args()
    if a.stored:
        return stored(a.stored)
    torch.set_num_threads(a.threads)
    z = zoo.build("gpt2", batch=a.batch, scale=a.scale)
    graph = capture(z.model, z.inputs)
    plan = eager_plan(graph, "cpu:0")
    env = bind_inputs(graph, z.model, z.inputs)
    print(
        f"gpt2 {a.scale}, batch {a.batch}: {len(graph.ops)} ops, eager plan on cpu:0, planned addresses (whole steps)"
    )
    print_counts(*kernel_counts(graph, plan), "cpu:0")
    exs = {
        "default": Executor(graph, plan, overlap=False),
        "arena": Executor(graph, plan, overlap=False, planned_addresses="whole"),
    }
    try:
        counted = {k: copies(ex, env) for k, ex in exs.items()}
        extra = counted["arena"][0] - counted["default"][0], counted["arena"][1] - counted["default"][1]
        print(
            f"aten::copy_ per step: default {counted['default'][0]} ({counted['default'][1] / MiB:,.1f} MiB), "
            f"arena {counted['arena'][0]} ({counted['arena'][1] / MiB:,.1f} MiB): {extra[0]} more, {extra[1] / MiB:,.1f} MiB"
        )
        times: dict[str, list[float]] = {k: [] for k in exs}
        for ex in exs.values():  # warm-up
            ex.run(ex.start(env))
        for _ in range(a.iters):
            for k, ex in exs.items():
                st = ex.start(env)
                t0 = time.perf_counter()
                ex.run(st)
                times[k].append(time.perf_counter() - t0)
        med = {k: statistics.median(v) for k, v in times.items()}
        print(
            f"step (median of {a.iters}, interleaved): default {med['default'] * 1e3:.1f} ms, arena {med['arena'] * 1e3:.1f} ms, "
            f"arena / default {med['arena'] / med['default']:.3f}"
        )
    finally:
        for ex in exs.values():
            ex.close()


if __name__ == "__main__":
    main()
