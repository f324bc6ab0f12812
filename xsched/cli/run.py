"""`xsched run`: run a plan on real devices, measured (after warm-up) beside the simulator's prediction (an ONNX
model's also beside a plain ONNX Runtime session)."""

from __future__ import annotations

import argparse
import dataclasses

from xsched.cli.common import add_shape_flag, parse_shape_flags, print_json
from xsched.contracts.plan import Plan
from xsched.errors import PlanError
from xsched.profiling.model import cost_profile
from xsched.profiling.store import load_profile


def cmd_run(args: argparse.Namespace) -> int:
    """`xsched run MODEL plan.json [--iters N] [--profile P] [--batch B] [--scale S] [--trace OUT.json]`: run a plan,
    print the report, and with --trace write a Chrome trace of one more run."""
    from xsched.capture.torch import bind_inputs, capture  # running a plan imports torch
    from xsched.devices.spec import target_device_type
    from xsched.execute.run_report import measure
    from xsched.loaders import load_model

    plan = Plan.load(args.plan)
    if args.model.endswith(".onnx"):
        return _run_onnx(args, plan)
    model, inputs = load_model(args.model, args.batch, args.scale)
    # typed for these devices as `xsched profile` and `train` capture it; else as `xsched capture` wrote the graph
    # file the plan was made for (typed for the CPU: a GPU runs it through the dtype adapters, dropout unfused)
    typed = target_device_type(plan.devices)
    tries = [(inference, t) for t in dict.fromkeys((typed, "cpu")) for inference in (False, True)]
    for inference, device_type in tries:
        graph = capture(model, inputs, inference=inference, name=args.model, device_type=device_type)
        if graph.fingerprint == plan.graph:
            break
    else:
        raise PlanError(
            f"{args.plan} was made for graph {plan.graph}; {args.model} (batch/scale as given) captures as "
            f"{graph.fingerprint}: plan it again for this model",
            stage="execute",
        )
    if args.profile:
        profile, source = load_profile(args.profile, graph, check_machine=False), f"profile {args.profile}"
    else:  # still predict a time, from the bytes each op touches, and say so
        profile, source = cost_profile(graph, plan.devices), "a bandwidth cost model (no --profile given)"
    env = bind_inputs(graph, model, inputs)
    report = measure(
        graph,
        plan,
        env,
        profile,
        iters=args.iters,
        warmup=args.warmup,
        predicted_from=source,
        compile=args.compile,
        expandable_segments=args.expandable_segments,
        planned_addresses="whole" if args.planned_addresses else False,  # whole steps: nothing handed midway
    )
    traced = None
    if args.trace:  # one more run, every step timed, after the measured ones (their timings stay untraced)
        from xsched.report.trace import measured_trace, write_trace

        trace = measured_trace(graph, plan, env)
        out = write_trace(trace, args.trace)
        steps = sum(e["ph"] == "X" for e in trace["traceEvents"])
        traced = {"trace": str(out), "steps": steps, "wall_s": trace["otherData"]["wall_s"]}
    if args.json:
        print_json({**report.as_dict(), **({"trace": traced} if traced else {})})
        return 0
    print(report.table())
    if traced:
        print(f"trace of one run ({traced['steps']} steps, {traced['wall_s'] * 1e3:.3f} ms) -> {traced['trace']}")
    return 0


def _run_onnx(args: argparse.Namespace, plan: Plan) -> int:
    """An ONNX model's plan on ONNX Runtime beside one plain session on the same providers."""
    from xsched.capture.onnx import capture_model
    from xsched.execute.ort_measure import measure_onnx

    captured = capture_model(args.model, parse_shape_flags(args.shape))
    graph = captured.graph
    if graph.fingerprint != plan.graph:
        raise PlanError(
            f"{args.plan} was made for graph {plan.graph}; {args.model} (input shapes as given) "
            f"captures as {graph.fingerprint}: plan it again for this model",
            stage="execute",
        )
    if args.profile:
        profile, source = load_profile(args.profile, graph, check_machine=False), f"profile {args.profile}"
    else:
        profile, source = cost_profile(graph, plan.devices), "a bandwidth cost model (no --profile given)"
    report = measure_onnx(
        graph, plan, captured.model, profile=profile, iters=args.iters, warmup=args.warmup, predicted_from=source
    )
    if args.json:
        print_json(dataclasses.asdict(report))
        return 0
    print(report.table())
    return 0


def add(sub: argparse._SubParsersAction) -> None:
    r = sub.add_parser("run", help="run a plan on real devices: predicted vs measured time, peak memory, energy")
    r.add_argument("model", help="zoo:NAME, path/to/file.py:factory or model.onnx (the model the plan was made for)")
    r.add_argument("plan", help="plan JSON")
    r.add_argument("--iters", type=int, default=20, help="measured runs, after the warm-up")
    r.add_argument("--warmup", type=int, help="warm-up runs (default: until the run time settles)")
    r.add_argument("--batch", type=int)
    r.add_argument("--scale", default="default", help="zoo size knob: tiny, small, default")
    r.add_argument("--profile", help="profile JSON for predictions (default: a bandwidth cost model, labelled)")
    r.add_argument(
        "--trace", metavar="OUT.json", help="also write a Chrome trace of one run (Perfetto: ui.perfetto.dev)"
    )
    r.add_argument("--json", action="store_true")
    r.add_argument(
        "--compile", action="store_true", help="run each one-device run of steps as one compiled region (inductor)"
    )
    r.add_argument(
        "--expandable-segments",
        action="store_true",
        help="turn on PyTorch's CUDA expandable_segments before the plan's first allocation (fewer reserved bytes "
        "lost to fragmentation, as `xsched plan --explain` predicts; a no-op on CPU devices)",
    )
    r.add_argument(
        "--planned-addresses",
        action="store_true",
        help="allocate the step's values at planned offsets in one buffer per device (MODeL's address assignment: "
        "no caching-allocator holes; ops without an out= variant and views run outside it; the outputs are valid "
        "until the next run)",
    )
    add_shape_flag(r)
    r.set_defaults(run=cmd_run)
