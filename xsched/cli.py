"""The `xsched` command line: capture, import, plan, simulate (and the later stages as they land)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from xsched.budgets import format_bytes
from xsched.errors import XschedError
from xsched.graph import Graph
from xsched.plan import Plan
from xsched.profile import Profile
from xsched.simulate import simulate


def load_model(spec: str, batch: int | None = None, scale: str = "default") -> tuple[Any, tuple]:
    """`zoo:NAME` or `path/to/file.py:factory` -> (model, example_inputs)."""
    if spec.startswith("zoo:"):
        from xsched import zoo

        z = zoo.build(spec[4:], batch=batch, scale=scale)
        return z.model, z.inputs
    path, _, factory = spec.rpartition(":")
    if not path.endswith(".py") or not factory:
        raise XschedError(f"MODEL must be zoo:NAME, file.py:factory or a bench graph .json, got {spec!r}", stage="cli")
    module_spec = importlib.util.spec_from_file_location(Path(path).stem, path)
    if module_spec is None or module_spec.loader is None or not Path(path).exists():
        raise XschedError(f"cannot load model file {path}", stage="cli")
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    fn = getattr(module, factory, None)
    if fn is None:
        raise XschedError(f"{path} has no function {factory!r}", stage="cli")
    kwargs = {"batch": batch} if batch is not None else {}
    model, inputs = fn(**kwargs)
    return model, tuple(inputs) if isinstance(inputs, (list, tuple)) else (inputs,)


def load_graph(spec: str, *, batch: int | None = None, scale: str = "default", inference: bool = False) -> Graph:
    """A graph from a graph JSON, an external bench graph, or a model spec (captured)."""
    if spec.endswith(".json"):
        data = json.loads(Path(spec).read_text())
        if data.get("schema", "").startswith("xsched.graph"):
            return Graph.from_dict(data)
        from xsched.importers import import_networkx

        return import_networkx(spec)[0]
    from xsched.capture.torch import capture

    model, inputs = load_model(spec, batch, scale)
    return capture(model, inputs, inference=inference, name=spec)


def cmd_capture(a: argparse.Namespace) -> int:
    g = load_graph(a.model, batch=a.batch, scale=a.scale, inference=a.inference)
    g.save(a.output)
    phases = {p: sum(o.phase == p for o in g.ops) for p in ("fwd", "loss", "bwd")}
    print(f"{g.name}: {len(g.ops)} ops ({phases}), {len(g.values)} values -> {a.output}")
    return 0


def cmd_import(a: argparse.Namespace) -> int:
    from xsched.importers import import_networkx

    g, p = import_networkx(a.file)
    g.save(a.output)
    if a.profile_out:
        p.save(a.profile_out)
    print(f"{g.name}: {len(g.ops)} ops, {sum(len(o.inputs) for o in g.ops)} input links -> {a.output}")
    return 0


def _parse_budget_flags(flags: Sequence[str]) -> dict[str, str]:
    out = {}
    for f in flags:
        dev, sep, spec = f.partition("=")
        if not sep:
            raise XschedError(f"--budget wants DEVICE=SIZE, got {f!r}", stage="cli")
        out[dev.strip()] = spec.strip()
    return out


def cmd_plan(a: argparse.Namespace) -> int:
    from xsched.devices.base import split_device_list
    from xsched.profiling import load_profile

    graph = Graph.load(a.graph)
    # Planning for another machine is allowed (graph check only); --reprofile re-measures a stale profile here.
    profile = load_profile(a.profile, graph, reprofile=a.reprofile, check_machine=a.reprofile)
    budgets = _parse_budget_flags(a.budget)
    devices = split_device_list(a.devices) if a.devices else None
    if a.method == "eager" and not budgets:
        from xsched.solve.eager import eager_plan

        device = (devices or list(profile.compute))[0]
        plan = eager_plan(graph, device, profile)
    else:
        from xsched.solve.api import solve
        from xsched.solve.options import SolverOptions

        options = SolverOptions(time_limit_s=a.time_limit, mip_gap=a.gap, solver=a.solver)
        plan = solve(
            graph, profile, budgets or {d: "100%" for d in (devices or profile.compute)}, devices, a.method, options
        )
    plan.save(a.output)
    p = plan.predicted
    s = plan.solver
    print(f"{s.method} ({s.status}, gap {s.gap}) in {s.solve_s:.2f} s: {len(plan.steps)} steps -> {a.output}")
    if p is not None:
        print(
            f"predicted time {p.time_s:.6g} s, peak "
            + ", ".join(f"{d}={format_bytes(b)}" for d, b in p.peak_bytes.items())
        )
    return 0


def cmd_simulate(a: argparse.Namespace) -> int:
    graph = Graph.load(a.graph)
    profile = Profile.load(a.profile) if a.profile else None
    plan = Plan.load(a.plan)
    r = simulate(graph, plan, profile)
    report = {
        "valid": True,
        "steps": len(plan.steps),
        "computes": r.computes,
        "recomputes": r.computes - len(graph.ops),
        "copies": r.copies,
        "copy_bytes": r.copy_bytes,
        "time_s": r.time_s,
        "makespan_s": r.makespan_s,
        "energy_j": r.energy_j,
        "peak_bytes": dict(r.peak_bytes),
        "budgets": dict(plan.budgets),
    }
    if a.json:
        print(json.dumps(report, indent=1))
        return 0
    print(
        f"valid plan for {graph.name}: {report['steps']} steps, {r.computes} computes ({report['recomputes']} recomputes), {r.copies} copies ({format_bytes(r.copy_bytes)})"
    )
    if r.time_s is not None:
        print(f"sequential time {r.time_s:.6g} s, overlapped makespan {r.makespan_s:.6g} s, energy {r.energy_j:.6g} J")
    for d, b in r.peak_bytes.items():
        budget = plan.budgets.get(d)
        print(
            f"  {d:>12}: peak {format_bytes(b):>12}"
            + (f" of budget {format_bytes(budget)}" if budget is not None else "")
        )
    return 0


def cmd_devices(a: argparse.Namespace) -> int:
    from xsched.profiling import cli_devices

    return cli_devices(a)


def cmd_profile(a: argparse.Namespace) -> int:
    from xsched.profiling import cli_profile

    return cli_profile(a)


def cmd_run(a: argparse.Namespace) -> int:
    from xsched.execute.report import cli_run

    return cli_run(a)


def cmd_demo(a: argparse.Namespace) -> int:
    from xsched.demo import run_demo

    return run_demo(a.model, a.scale, a.gpu, a.gpu_budget, a.time_limit)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="xsched", description=__doc__)
    sub = ap.add_subparsers(dest="command", required=True)

    c = sub.add_parser("capture", help="capture a model's training (or inference) graph")
    c.add_argument(
        "model", help="zoo:NAME, path/to/file.py:factory returning (model, example_inputs), or a bench graph .json"
    )
    c.add_argument("--batch", type=int)
    c.add_argument("--scale", default="default", help="zoo size knob: tiny, small, default")
    c.add_argument("--inference", action="store_true", help="forward only")
    c.add_argument("-o", "--output", required=True)
    c.set_defaults(run=cmd_capture)

    i = sub.add_parser("import", help="import an external networkx node-link graph (Checkmate / Moccasin)")
    i.add_argument("file")
    i.add_argument("-o", "--output", required=True)
    i.add_argument("--profile-out")
    i.set_defaults(run=cmd_import)

    p = sub.add_parser("plan", help="solve for a plan under per-device budgets")
    p.add_argument("graph")
    p.add_argument("profile")
    p.add_argument("--method", default="eager", help="eager, milp, greedy, fastest, sqrt, checkpoint, offload")
    p.add_argument(
        "--budget", action="append", default=[], help="DEVICE=SIZE, e.g. cpu=16GiB or cuda:0=50%% (repeatable)"
    )
    p.add_argument("--devices", help="comma-separated devices (default: the budgets' devices)")
    p.add_argument("--time-limit", type=float, default=60.0)
    p.add_argument("--gap", type=float, default=1e-4)
    p.add_argument("--solver", default="highs")
    p.add_argument(
        "--reprofile", action="store_true", help="re-profile when the profile is stale for this graph or machine"
    )
    p.add_argument("-o", "--output", required=True)
    p.set_defaults(run=cmd_plan)

    d = sub.add_parser("devices", help="this machine's devices and the simulated device specs")
    d.add_argument("--json", action="store_true")
    d.add_argument("--no-sim", action="store_true", help="hide simulated specs")
    d.set_defaults(run=cmd_devices)

    f = sub.add_parser("profile", help="measure every op on every device and every copy between them")
    f.add_argument("model", help="zoo:NAME, file.py:factory or graph.json")
    f.add_argument("--devices", default="cpu", help="e.g. cpu,cpu:threads=1,clock=thread,cuda:0,sim:h100,sim:h100#1")
    f.add_argument("-o", "--output", help="default: profiles/<graph>-<fingerprint>-<devices>.json")
    f.add_argument("--batch", type=int)
    f.add_argument("--scale", default="default")
    f.add_argument("--reps", type=int, help="most samples per op and round")
    f.add_argument("--max-time", type=float, help="seconds; after this the remaining ops are measured quickly")
    f.add_argument("--pageable", action="store_true", help="copy costs for pageable host memory (default pinned)")
    f.add_argument("--quiet", action="store_true")
    f.set_defaults(run=cmd_profile)

    r = sub.add_parser("run", help="run a plan on real devices: predicted vs measured time, peak memory, energy")
    r.add_argument("model", help="zoo:NAME or path/to/file.py:factory (the model the plan was made for)")
    r.add_argument("plan", help="plan JSON")
    r.add_argument("--iters", type=int, default=10)
    r.add_argument("--batch", type=int)
    r.add_argument("--scale", default="default", help="zoo size knob: tiny, small, default")
    r.add_argument("--profile", help="profile JSON for predictions (default: a bandwidth cost model, labelled)")
    r.set_defaults(run=cmd_run)

    s = sub.add_parser("simulate", help="validate a plan and predict its time, memory and energy")
    s.add_argument("graph")
    s.add_argument("profile", nargs="?", help="profile JSON (without it: validity and memory only)")
    s.add_argument("plan")
    s.add_argument("--json", action="store_true")
    s.set_defaults(run=cmd_simulate)
    m = sub.add_parser("demo", help="the whole pipeline on a zoo model: capture, profile, solve, simulate, run")
    m.add_argument("--model", default="resnet18")
    m.add_argument("--scale", default="tiny")
    m.add_argument("--gpu", default="sim:rtx4090", help="a simulated GPU (sim:<spec>) or cuda:0")
    m.add_argument("--gpu-budget", default="4GiB")
    m.add_argument("--time-limit", type=float, default=20.0)
    m.set_defaults(run=cmd_demo)
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.run(args))
    except XschedError as e:
        print(f"xsched: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
