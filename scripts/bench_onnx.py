"""ONNX models on ONNX Runtime: profiling wall time, profile fidelity, and the overhead of placed execution.

For each zoo model (eval mode, exported by torch.onnx's dynamo exporter): capture its inference graph, profile
every node alone on the ORT device, and compare
  * the sum of profiled node times (the eager plan's predicted sequential time) with one plain ONNX Runtime
    session, optimisations off (nodes stay nodes, as profiled) and on (ORT's fusions and layouts, what users run);
  * the eager plan run by the placed executor (one segment: one session) with the plain session, both with
    optimisations on: the overhead ratio (target <= 5%);
  * with --reduced, a plan on two logical CPUs at a budget below the eager peak (xsched.solve "offload": values
    parked on the second device): its segments and its time against the plain session.
Runs are interleaved (placed, plain, placed, ...), medians of --iters after warm-up. With a clock=thread device
(one intra-op thread) times are the calling thread's CPU time, robust to other jobs on the machine.

    python scripts/bench_onnx.py --scale default --device ort:cpu,threads=1,clock=thread --iters 10 \\
        --out docs/bench/onnx.md
"""

from __future__ import annotations

import argparse
import io
import logging
import platform
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from xsched import zoo
from xsched.capture.onnx import capture_model
from xsched.devices import get_device
from xsched.devices.cpu import cpu_model
from xsched.execute.ort_executor import OrtExecutor, plain_session
from xsched.execute.ort_measure import example_feeds
from xsched.profiling.measure import profile_graph
from xsched.simulate import simulate
from xsched.solve.api import solve
from xsched.solve.reference import eager_plan

MODELS = ("resnet18", "resnet50", "vgg16", "unet", "gpt2", "transformer", "mlp_mixer")
NOTES = """\
Columns: *sum of profiled node times* is the eager plan's sequential time predicted from the profile (every node
once, each at its profiled median: single-node sessions, optimisations off); *plain session* is one ordinary
InferenceSession of the whole model at the device's thread count, graph optimisations off (nodes stay nodes, as
profiled) or on (ORT_ENABLE_ALL: fusions, constant folding, NCHWc layouts: what users run); *ratio* = predicted /
measured. *placed eager* is the eager plan run by `xsched.execute.ort_executor.OrtExecutor` (one segment, so one session,
params as shared initializers); *overhead* = placed / plain at the same optimisation level. The second table is
an `offload` plan on two logical CPUs at a budget below the eager peak (the one measured CPU's node costs for
both, the copy link measured): its segments (sessions run), copies, and time against the plain session (opt on).
"""


def export(name: str, scale: str) -> Any:
    """The zoo model in eval mode as an ONNX ModelProto (dynamo exporter; gpt2 without its targets)."""
    import onnx

    z = zoo.build(name, scale=scale)
    inputs = z.inputs[:1] if name == "gpt2" else z.inputs
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        logging.disable(logging.WARNING)
        try:
            return torch.onnx.export(z.model.eval(), inputs, dynamo=True, verbose=False).model_proto
        except Exception:  # an exporter gap: the TorchScript exporter
            buf = io.BytesIO()
            torch.onnx.export(z.model.eval(), inputs, buf, dynamo=False)
            return onnx.load_from_string(buf.getvalue())
        finally:
            logging.disable(logging.NOTSET)


def interleaved(calls: dict[str, Callable[[], Any]], iters: int, warmup: int, clock: Callable[[], float]) -> dict:
    """Median seconds per call of each, calls interleaved so drifts in machine load hit all alike."""
    times: dict[str, list[float]] = {k: [] for k in calls}
    for k in range(warmup + iters):
        for key, call in calls.items():
            t0 = clock()
            call()
            if k >= warmup:
                times[key].append(clock() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def bench_model(name: str, args: argparse.Namespace) -> dict[str, Any]:
    dev = get_device(args.device)
    clock = time.thread_time if getattr(dev, "clock", "wall") == "thread" else time.perf_counter
    t0 = time.perf_counter()
    model = export(name, args.scale)
    exported = time.perf_counter() - t0
    t0 = time.perf_counter()
    c = capture_model(model, name=name)
    captured = time.perf_counter() - t0
    g = c.graph
    profile = profile_graph(g, [dev.name], progress=False)
    predicted = simulate(g, eager_plan(g, dev.name), profile).time_s
    feeds = example_feeds(g)
    eager = eager_plan(g, dev.name)
    placed = OrtExecutor(g, eager, c.model, optimization="all")
    placed_off = OrtExecutor(g, eager, c.model, optimization="disabled")
    plain = plain_session(c.model, [dev.name], "all")
    plain_off = plain_session(c.model, [dev.name], "disabled")
    t = interleaved(
        {
            "placed": lambda: placed.run(feeds),
            "plain": lambda: plain.run(None, feeds),
            "placed_off": lambda: placed_off.run(feeds),
            "plain_off": lambda: plain_off.run(None, feeds),
        },
        args.iters,
        2,
        clock,
    )
    row = {
        "model": name,
        "nodes": len(g.ops),
        "signatures": profile.profiling["signatures"],
        "export_s": exported,
        "capture_s": captured,
        "profile_s": profile.profiling["wall_s"],
        "predicted": predicted,
        **t,
    }
    if args.reduced:
        row.update(reduced(c, dev.name, feeds, profile, args, clock))
    return row


def reduced(c: Any, device: str, feeds: dict, profile: Any, args: argparse.Namespace, clock: Callable) -> dict:
    """An offload plan on two logical CPUs (the one measured CPU's node costs for both, the copy link measured) at
    args.budget of the way from the graph inputs' bytes to the eager peak; its placed time against the plain
    session."""
    from xsched.contracts.profile import LinkCost, Profile
    from xsched.devices.base import fit_link
    from xsched.profiling.measure import COPY_SIZES, copy_seconds

    g = c.graph
    a, b = (device.replace("ort:cpu", f"ort:cpu:{k}", 1) for k in (0, 1))
    link = LinkCost(*fit_link(COPY_SIZES, [copy_seconds(get_device(a), get_device(b), n) for n in COPY_SIZES]))
    compute = {a: profile.compute[device], b: profile.compute[device]}
    info = {a: profile.devices[device], b: profile.devices[device]}
    both = Profile(
        profile.graph,
        info,
        compute,
        {f"{a}->{b}": link, f"{b}->{a}": link},
        {a: "model", b: "model"},
        {"note": "the one measured CPU's node costs for both logical CPUs"},
    )
    inputs = sum(g.value[v].nbytes for v in g.inputs)
    peak = max(simulate(g, eager_plan(g, a)).peak_bytes.values())
    budgets = {a: int(inputs + args.budget * (peak - inputs)), b: peak - inputs}
    try:
        plan = solve(g, both, budgets, [a, b], method="offload")
    except Exception as e:
        return {"reduced": f"no plan: {type(e).__name__}"}
    ex = OrtExecutor(g, plan, c.model, optimization="all")
    plain = plain_session(c.model, [device], "all")
    t = interleaved({"placed": lambda: ex.run(feeds), "plain": lambda: plain.run(None, feeds)}, args.iters, 2, clock)
    copies = sum(type(s).__name__ == "Copy" for s in plan.steps)
    return {
        "reduced": "ok",
        "segments": len(ex.segments),
        "copies": copies,
        "r_placed": t["placed"],
        "r_plain": t["plain"],
        "r_predicted": plan.predicted.time_s if plan.predicted else None,
        "r_budget": budgets[a] / peak,
    }


def table(rows: list[dict[str, Any]], reduced_rows: bool) -> str:
    lines = [
        "| model | nodes | distinct | profiling wall s | sum of profiled node times ms | plain session, opt off ms | "
        "ratio | plain session, opt on ms | ratio | placed eager, opt on ms | overhead | placed eager, opt off ms "
        "| overhead |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['nodes']} | {r['signatures']} | {r['profile_s']:.1f} | {r['predicted'] * 1e3:.2f} "
            f"| {r['plain_off'] * 1e3:.2f} | {r['predicted'] / r['plain_off']:.3f} | {r['plain'] * 1e3:.2f} | "
            f"{r['predicted'] / r['plain']:.3f} | {r['placed'] * 1e3:.2f} | {r['placed'] / r['plain']:.3f} | "
            f"{r['placed_off'] * 1e3:.2f} | {r['placed_off'] / r['plain_off']:.3f} |"
        )
    if reduced_rows:
        lines += [
            "",
            "| model | budget (of eager peak) | segments | copies | placed ms | plain session ms | ratio | "
            "predicted ms |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in rows:
            if r.get("reduced") != "ok":
                lines.append(f"| {r['model']} | - | {r.get('reduced', '-')} | | | | | |")
                continue
            pred = f"{r['r_predicted'] * 1e3:.2f}" if r["r_predicted"] is not None else "-"
            lines.append(
                f"| {r['model']} | {r['r_budget']:.0%} | {r['segments']} | {r['copies']} | "
                f"{r['r_placed'] * 1e3:.2f} | {r['r_plain'] * 1e3:.2f} | {r['r_placed'] / r['r_plain']:.3f} | "
                f"{pred} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scale", default="default")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--device", default="ort:cpu,threads=1,clock=thread")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--reduced", action="store_true", help="also an offload plan on two logical CPUs")
    ap.add_argument("--budget", type=float, default=0.9, help="--reduced: budget between inputs (0) and peak (1)")
    ap.add_argument("--out", help="write the markdown here too")
    args = ap.parse_args(argv)
    import onnxruntime as ort

    rows = []
    for name in args.models.split(","):
        rows.append(bench_model(name, args))
        print(f"{name}: done ({rows[-1]['profile_s']:.0f} s profiling)", file=sys.stderr)
    text = table(rows, args.reduced)
    print(text)
    if args.out:
        m = cpu_model()
        head = (
            f"## ONNX models on ONNX Runtime (scale {args.scale})\n\nCommand: `python scripts/bench_onnx.py "
            f"{' '.join(sys.argv[1:] if argv is None else argv)}`  \nMachine: {m['brand']}, {m['logical_cores']} "
            f"logical cores, onnxruntime {ort.__version__}, torch {torch.__version__}, Python "
            f"{platform.python_version()}; device {args.device}\n\n"
        )
        Path(args.out).write_text(head + text + "\n\n" + NOTES)
    return 0


if __name__ == "__main__":
    sys.exit(main())
