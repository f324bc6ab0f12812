"""`xsched report`: what-if reports (budget sweep, device what-if, energy, plan pictures) as one HTML file with
its numbers beside it."""

from __future__ import annotations

import argparse
import json
import shlex
import sys

from xsched.cli.common import seconds
from xsched.contracts.graph import Graph
from xsched.contracts.profile import Profile
from xsched.errors import XschedError

DEFAULT_MACHINE = "sim:rtx4090+cpu"


def _csv(text: str) -> tuple[str, ...]:
    return tuple(p.strip() for p in text.split(",") if p.strip())


def cmd_report(a: argparse.Namespace) -> int:
    """`xsched report MODEL|graph.json --machine DEV[@BUDGET]+DEV... -o DIR`: solve every what-if, write the report."""
    from xsched.report.build import ReportSettings, build_report, check_settings
    from xsched.report.machines import parse_machine, union_devices
    from xsched.report.sweep import SweepSettings

    machines = [parse_machine(m) for m in (a.machine or [DEFAULT_MACHINE])]
    if a.points < 2:
        raise XschedError(f"--points must be at least 2, got {a.points}", stage="cli")
    settings = ReportSettings(
        SweepSettings(a.method, a.time_limit, a.points, _csv(a.baselines)),
        _csv(a.sections),
        progress=not a.quiet,
        measured=a.measured,
    )
    check_settings(settings)  # matplotlib, sections, methods: before capturing and profiling
    devices = union_devices(machines)
    graph = _graph(a, devices)
    profile = _profile(a, graph, devices)
    command = shlex.join(["xsched", *getattr(a, "argv", [])]) if getattr(a, "argv", None) else ""
    report = build_report(graph, profile, machines, a.output, settings, command)
    if a.json:
        print(json.dumps(report.summary, indent=1, default=str))
        return 0
    print(f"{graph.name}: report -> {report.html} ({report.summary['build_s']:.0f} s)")
    for m in report.summary["machines"]:
        best = m["best"]
        what = (
            "no plan"
            if best is None
            else f"{best['time_s'] * 1e3:.4g} ms, {best['energy_j']:.4g} J ({best['found_by']})"
        )
        print(f"  {m['machine']:<40} {what}")
    return 0


def _graph(a: argparse.Namespace, devices: list[str]) -> Graph:
    """The model captured for `devices`, as `xsched profile` types it (a graph or ONNX file is taken as it is); or,
    where the --profile given was made on the CPU's capture (`xsched profile MODEL --devices cpu`), that capture."""
    from xsched.devices.spec import target_device_type
    from xsched.loaders import load_graph

    typed = target_device_type(devices)
    graph = load_graph(a.model, batch=a.batch, scale=a.scale, device_type=typed)
    if not a.profile or typed == "cpu":
        return graph
    try:
        made_on = Profile.load(a.profile).graph
    except XschedError:  # unreadable: loading it for the graph says why
        return graph
    if made_on == graph.fingerprint:
        return graph
    cpu = load_graph(a.model, batch=a.batch, scale=a.scale, device_type="cpu")
    if cpu.fingerprint != made_on:
        return graph  # a profile of another model: loading it for the graph says so
    print(
        f"xsched: {a.profile} was made on the CPU's capture of {a.model}: the report plans that graph, so its GPUs are"
        " modelled on the CPU's kernels (dropout unfused); profile with a GPU among --devices for the graph a GPU runs",
        file=sys.stderr,
    )
    return cpu


def _profile(a: argparse.Namespace, graph: Graph, devices: list[str]) -> Profile:
    """The given profile with the devices it lacks added, or a new one: simulated devices modelled, real ones
    measured and (unless --no-back-to-back) calibrated by their eager step back to back, as `xsched profile` does."""
    from xsched.profiling.store import load_profile

    bars = not a.quiet and sys.stderr.isatty()  # like the report's own bar: none into a log file
    given = load_profile(a.profile, graph, check_machine=False) if a.profile else None
    if given is not None and all(d in given.devices for d in devices):
        return given  # nothing to measure (measuring imports torch)
    from xsched.profiling.measure import extend_profile, profile_graph

    measure = profile_graph
    if not a.no_back_to_back:  # the eager steps back to back are counted in --max-profile-time
        from xsched.execute.back_to_back import profile_calibrated as measure
    if given is not None:
        return extend_profile(graph, given, devices, measure=measure, max_total_s=a.max_profile_time, progress=bars)
    return measure(graph, devices, max_total_s=a.max_profile_time, progress=bars)


def add(sub: argparse._SubParsersAction) -> None:
    r = sub.add_parser(
        "report",
        help="what-if report: time against budgets, machines and energy, and pictures of a plan (HTML + CSV/JSON)",
    )
    r.add_argument("model", help="zoo:NAME, path/to/file.py:factory or a graph .json")
    r.add_argument(
        "--machine",
        action="append",
        help="devices planned together, the first the home of inputs: DEV[@BUDGET]+DEV..., e.g. sim:a100-40gb+cpu, "
        "sim:l4#0+sim:l4#1+cpu, sim:rtx4090@60%%mem+cpu (BUDGET: 4GiB, 50%% of the eager peak, 60%%mem of the "
        f"device's memory; default its memory); repeatable (default {DEFAULT_MACHINE})",
    )
    r.add_argument("-o", "--output", required=True, help="folder for report.html and its data files")
    r.add_argument("--profile", help="a profile to start from; devices it lacks are profiled and added")
    r.add_argument("--batch", type=int)
    r.add_argument("--scale", default="default", help="zoo size knob: tiny, small, default")
    r.add_argument("--method", default="auto", help="the solver at each point (auto; a heuristic is cheaper)")
    r.add_argument("--time-limit", type=seconds, default=2.0, help="seconds per plan (default 2)")
    r.add_argument("--points", type=int, default=8, help="budgets per sweep (default 8)")
    r.add_argument("--baselines", default="eager,greedy,checkpoint", help="heuristics beside the solver ('' none)")
    r.add_argument("--sections", default="sweep,whatif,energy,pictures", help="which what-ifs to build")
    r.add_argument(
        "--max-profile-time",
        type=float,
        default=30.0,
        help="profiling's time cap, seconds: ops it leaves unmeasured are modelled",
    )
    r.add_argument(
        "--no-back-to-back",
        action="store_true",
        help="skip timing the eager step on each CPU and GPU measured (the calibration of ops run back to back)",
    )
    r.add_argument("--measured", help="a scripts/bench_gpu_memory.py --json file: adds its measured time/peak frontier")
    r.add_argument("--quiet", action="store_true", help="no progress bars")
    r.add_argument("--json", action="store_true", help="print the summary as JSON")
    r.set_defaults(run=cmd_report)
