"""`xsched plan` and `xsched simulate`: solve for a plan under budgets, and check one with the simulator."""

from __future__ import annotations

import argparse
import time

from xsched.budgets import format_bytes
from xsched.cli.common import parse_budget_flags, print_json, quiet, relative_gap, seconds, timed_progress
from xsched.contracts.graph import Graph
from xsched.contracts.plan import Plan
from xsched.profiling.store import load_profile
from xsched.simulate import simulate


def cmd_plan(a: argparse.Namespace) -> int:
    from xsched.devices.base import split_device_list

    graph = Graph.load(a.graph)
    # Planning for another machine is allowed (graph check only); --reprofile re-measures a stale profile here,
    # calibrated back to back as `xsched profile` measures (imported only then: planning from files needs no torch)
    measure = None
    if a.reprofile:
        from xsched.execute.back_to_back import profile_calibrated as measure
    profile = load_profile(a.profile, graph, reprofile=a.reprofile, check_machine=a.reprofile, measure=measure)
    if a.compile:  # the plan runs as compiled regions (`xsched run --compile`): its ops priced as fused
        from xsched.profiling.fused import fused_profile

        for d in [d for d in profile.compute if profile.compute[d]]:
            profile = fused_profile(graph, profile, d)
    budgets = parse_budget_flags(a.budget)
    devices = split_device_list(a.devices) if a.devices else None
    if a.method == "eager" and not budgets:
        from xsched.solve.reference import eager_plan

        device = (devices or list(profile.compute))[0]
        plan = eager_plan(graph, device, profile)
    else:
        from xsched.solve.api import solve
        from xsched.solve.options import SolverOptions

        # the limit is the command's: what loading took is not the solver's
        limit = max(a.time_limit - (time.perf_counter() - a.started), 0.0)
        options = SolverOptions(
            time_limit_s=limit,
            mip_gap=a.gap,
            solver=a.solver,
            fit_reserved=a.fit_reserved,
            expandable_segments=a.expandable_segments,
        )
        with timed_progress(f"solving ({a.method})", limit, quiet(a)):
            plan = solve(
                graph, profile, budgets or {d: "100%" for d in (devices or profile.compute)}, devices, a.method, options
            )
    plan.save(a.output)
    rows = bounds = None
    if a.explain:
        from xsched.explain import explain
        from xsched.solve.bounds.time import time_bounds

        rows = explain(graph, plan, profile)
        bounds = time_bounds(graph, profile, plan.devices, plan.homes, plan.budgets)
    p, s = plan.predicted, plan.solver
    if a.json:
        out = {
            "plan": a.output,
            "method": s.method,
            "status": s.status,
            "gap": s.gap,
            "solve_s": s.solve_s,
            "found_by": s.found_by,
            "objective": s.objective,
            "bound": s.bound,
            "steps": len(plan.steps),
            "time_s": p.time_s if p else None,
            "makespan_s": p.makespan_s if p else None,
            "energy_j": p.energy_j if p else None,
            "peak_bytes": dict(p.peak_bytes) if p else {},
            "budgets": dict(plan.budgets),
        }
        if rows is not None:
            out["explain"] = [r.as_dict() for r in rows]
            out["makespan_bounds"] = [{"seconds": b.seconds, "by": b.by, "why": b.why} for b in bounds]
            from xsched.allocator import replay_reserved
            from xsched.explain import expected_reserved

            out["reserved"] = {d: r.as_dict() for d, r in replay_reserved(graph, plan, profile).items()}
            # per accelerator: default settings, expandable segments, planned addresses (each the GPU keeping up,
            # the host a step ahead), the arena's bytes and what stays outside it: the text's figures
            out["reserved_expected"] = {d: e.as_dict() for d, e in expected_reserved(graph, plan, profile).items()}
        print_json(out)
        return 0
    found = f", found by {s.found_by}" if s.found_by != s.method else ""
    print(f"{s.method} ({s.status}, gap {s.gap}{found}) in {s.solve_s:.2f} s: {len(plan.steps)} steps -> {a.output}")
    if p is not None:
        print(
            f"predicted makespan {p.makespan_s:.6g} s (sequential {p.time_s:.6g} s), peak "
            + ", ".join(f"{d}={format_bytes(b)}" for d, b in p.peak_bytes.items())
        )
    if bounds:
        b = bounds[0]
        print(f"no plan's makespan is below {b.seconds:.6g} s ({b.by}: {b.why})")
    if rows is not None:
        from xsched.explain import explain_table, reserved_text

        print(explain_table(rows))
        if text := reserved_text(graph, plan, profile):
            print(text)
    return 0


def cmd_simulate(a: argparse.Namespace) -> int:
    graph = Graph.load(a.graph)
    profile = load_profile(a.profile, graph, check_machine=False) if a.profile else None
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
        print_json(report)
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


def add(sub: argparse._SubParsersAction) -> None:
    from xsched.solve.registry import SOLVERS

    p = sub.add_parser("plan", help="solve for a plan under per-device budgets")
    p.add_argument("graph")
    p.add_argument("profile")
    p.add_argument("--method", default="auto", help=f"auto (default), {', '.join(m for m in SOLVERS if m != 'auto')}")
    p.add_argument(
        "--budget", action="append", default=[], help="DEVICE=SIZE, e.g. cpu=16GiB or cuda:0=50%% (repeatable)"
    )
    p.add_argument("--devices", help="comma-separated devices (default: the budgets' devices)")
    p.add_argument(
        "--time-limit",
        type=seconds,
        default=60.0,
        help="seconds for the command, reading the graph and profile included (default 60); it returns within "
        "this x 1.1 + 1 s",
    )
    p.add_argument("--gap", type=relative_gap, default=1e-4)
    p.add_argument("--solver", default="highs")
    p.add_argument(
        "--reprofile", action="store_true", help="re-profile when the profile is stale for this graph or machine"
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="price the ops as compiled regions fuse them (fusible ops free), for `xsched run --compile`",
    )
    p.add_argument("--explain", action="store_true", help="why each value is kept, recomputed or moved")
    p.add_argument(
        "--fit-reserved",
        action="store_true",
        help="re-plan at lower budgets until each GPU's predicted reserved memory (caching allocator) fits its budget",
    )
    p.add_argument(
        "--expandable-segments",
        action="store_true",
        help="with --fit-reserved: the plan will run with CUDA's expandable segments (xsched run/train "
        "--expandable-segments), so its reserved memory is predicted with them",
    )
    p.add_argument("--json", action="store_true")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("-o", "--output", required=True)
    p.set_defaults(run=cmd_plan)

    s = sub.add_parser("simulate", help="validate a plan and predict its time, memory and energy")
    s.add_argument("graph")
    s.add_argument("profile", nargs="?", help="profile JSON (without it: validity and memory only)")
    s.add_argument("plan")
    s.add_argument("--json", action="store_true")
    s.set_defaults(run=cmd_simulate)
