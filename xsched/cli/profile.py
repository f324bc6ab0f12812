"""`xsched devices` and `xsched profile`: what this machine has, and measuring a graph's costs on it."""

from __future__ import annotations

import argparse
import dataclasses
import json

from xsched.budgets import format_bytes
from xsched.cli.common import add_shape_flag, cap_seconds, parse_shape_flags, print_json, quiet
from xsched.devices.base import Policy, available_devices, split_device_list
from xsched.profiling.store import default_profile_path, save_profile


def cmd_devices(args: argparse.Namespace) -> int:
    """`xsched devices [--json] [--no-sim]`: what this machine has, and the simulated specs."""
    rows = available_devices(include_sim=not args.no_sim)
    if args.json:
        print(json.dumps([dataclasses.asdict(r) for r in rows], indent=1, default=str))
        return 0
    width = max((len(r.name) for r in rows), default=4)
    for r in rows:
        keys = ("logical_cores", "energy", "driver", "power_limit_w", "spec")
        extra = ", ".join(f"{k}={v}" for k, v in r.details.items() if k in keys)
        if r.kind == "sim":
            d = r.details
            extra = (
                f"simulated: {d['peak_float32_flops'] / 1e12:.3g} TFLOP/s fp32, {d['memory_bandwidth'] / 1e9:.4g} GB/s"
            )
        print(
            f"{r.name:<{width}}  {format_bytes(r.memory_bytes):>10}  {r.description}"
            + (f"  [{extra}]" if extra else "")
        )
    return 0


def cmd_profile(args: argparse.Namespace) -> int:
    """`xsched profile MODEL|graph.json --devices cpu,cuda:0,sim:h100 [--store cpu] -o profile.json [--reps N]
    [--max-time S]`."""
    from xsched.devices.spec import target_device_type
    from xsched.loaders import load_graph  # capturing and measuring import torch
    from xsched.profiling.measure import profile_graph

    names = split_device_list(str(args.devices))
    stores = [s for text in args.store for s in split_device_list(text)]
    shapes, typed = parse_shape_flags(args.shape), target_device_type([*names, *stores])  # typed as `train` does
    graph = load_graph(args.model, batch=args.batch, scale=args.scale, shapes=shapes, device_type=typed)
    base = Policy()
    policy = dataclasses.replace(base, max_reps=args.reps or base.max_reps)
    measure = profile_graph
    if not args.no_back_to_back:  # the eager steps back to back are counted in --max-time
        from xsched.execute.back_to_back import profile_calibrated as measure
    profile = measure(
        graph,
        names,
        stores=stores,
        policy=policy,
        max_total_s=args.max_time,
        pinned=not args.pageable,
        progress=not quiet(args),
    )
    out = save_profile(profile, args.output or default_profile_path(graph, names, stores))
    wall = profile.profiling["wall_s"]
    if args.json:
        print_json(
            {
                "profile": str(out),
                "graph": graph.name,
                "ops": len(graph.ops),
                "wall_s": wall,
                "distinct": profile.profiling["signatures"],
                "devices": {
                    d: {
                        "ops": len(profile.compute[d]),
                        "sum_time_s": sum(c.time_s for c in profile.compute[d].values()),
                        "energy_source": profile.energy_source[d],
                        **(
                            {"back_to_back": dataclasses.asdict(profile.back_to_back[d])}
                            if d in profile.back_to_back
                            else {}
                        ),
                    }
                    for d in names
                },
                "stores": stores,
                "modelled_ops": {d: len(ids) for d, ids in profile.extra.get("modelled_ops", {}).items()},
                "copy": {
                    k: {"latency_s": link.latency_s, "bytes_per_s": link.bytes_per_s}
                    for k, link in profile.copy.items()
                },
            }
        )
        return 0
    on = f"{len(names)} devices" + (f" and {len(stores)} store{'s' * (len(stores) > 1)}" if stores else "")
    print(
        f"{graph.name}: {len(graph.ops)} ops ({profile.profiling['signatures']} distinct) on {on} in {wall:.1f} s -> {out}"
    )
    modelled = profile.extra.get("modelled_ops", {})
    for d in names:
        ops = profile.compute[d]
        total = sum(c.time_s for c in ops.values())
        late = f"  ({len(modelled[d])} modelled: not measured within --max-time)" if d in modelled else ""
        print(
            f"  {d:<16} {len(ops):>5}/{len(graph.ops)} ops  sum {total * 1e3:10.3f} ms  energy: {profile.energy_source[d]}{late}"
        )
        if d in profile.back_to_back:
            b = profile.back_to_back[d]
            print(
                f"  {'':<16} eager step back to back {b.step_s * 1e3:10.3f} ms  overhead {b.overhead_s * 1e6:+.1f} us/op"
            )
    for d in stores:
        print(f"  {d:<16} store: holds values, runs no op (copies only)")
    for key, link in profile.copy.items():
        print(f"  {key:<32} {link.latency_s * 1e6:8.2f} us + {link.bytes_per_s / 1e9:8.2f} GB/s")
    return 0


def add(sub: argparse._SubParsersAction) -> None:
    d = sub.add_parser("devices", help="this machine's devices and the simulated device specs")
    d.add_argument("--json", action="store_true")
    d.add_argument("--no-sim", action="store_true", help="hide simulated specs")
    d.set_defaults(run=cmd_devices)

    f = sub.add_parser(
        "profile", help="measure every op on every device and every copy between them (and to and from the stores)"
    )
    f.add_argument("model", help="zoo:NAME, file.py:factory, model.onnx or graph.json")
    f.add_argument(
        "--devices",
        default="cpu",
        help="e.g. cpu,cpu:threads=1,clock=thread,cuda:0,sim:h100,sim:h100#1; ort:cpu,ort:cuda:0",
    )
    add_shape_flag(f)
    f.add_argument("-o", "--output", help="default: profiles/<graph>-<fingerprint>-<devices>.json")
    f.add_argument("--batch", type=int)
    f.add_argument("--scale", default="default")
    f.add_argument("--reps", type=int, help="most samples per op and round")
    f.add_argument(
        "--store",
        action="append",
        default=[],
        help="a device that holds values and runs no op, e.g. cpu: only its copies are timed (repeatable)",
    )
    f.add_argument(
        "--max-time",
        type=cap_seconds,
        help="seconds for the whole run, the eager steps back to back included (a tenth kept for them); ops it leaves"
        " unmeasured are modelled (listed in the profile)",
    )
    f.add_argument("--pageable", action="store_true", help="copy costs for pageable host memory (default pinned)")
    f.add_argument(
        "--no-back-to-back",
        action="store_true",
        help="skip timing the eager step on each CPU and GPU (the calibration of ops run back to back)",
    )
    f.add_argument("--quiet", action="store_true", help="no progress bar")
    f.add_argument("--json", action="store_true")
    f.set_defaults(run=cmd_profile)
