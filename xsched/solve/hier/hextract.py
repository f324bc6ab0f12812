"""H-ILP schedules into plans: a solution's (or a greedy schedule's, or a fixed choice's) events as steps, frees
placed after last reads within the model's assumptions, checked by the simulator against the budgets."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

import numpy as np
import pyomo.environ as pyo

from xsched.contracts.plan import Copy, Free, Plan, Step, autograd_boundary, place_frees
from xsched.contracts.profile import Profile
from xsched.contracts.result import SolveResult
from xsched.errors import XschedError
from xsched.simulate import predicted_plan
from xsched.solve.autograd_boundary import hold_to_boundary
from xsched.solve.heuristics.routing import copy_chain, finish, with_early_homes
from xsched.solve.hier.hindex import HIndex
from xsched.solve.hier.menu import Part
from xsched.solve.hier.park import kept_frees, with_kept_frees
from xsched.solve.milp.extract import free_unwanted_ends, prune


def event_steps(ix: HIndex, events: Sequence) -> list[Step]:
    """A schedule's events in order: each copy, each run's part steps without frees."""
    steps: list[Step] = []
    for e in events:
        if e[0] == "copy":
            steps.append(Copy(ix.values[e[1]], ix.devices[e[2]], ix.devices[e[3]]))
        else:
            steps += part_steps(ix, ix.parts[e[1]][e[2]])
    return steps


def part_steps(ix: HIndex, part: Part) -> list[Step]:
    """A part's steps without its frees, but for those of its parked values (finish_plan keeps them there)."""
    kept = kept_frees(ix.graph, part.steps, ix.profile)
    return [s for i, s in enumerate(part.steps) if not isinstance(s, Free) or i in kept]


def event_ends(ix: HIndex, events: Sequence) -> set[tuple[str, str]]:
    """Where the outputs are at the end of a schedule's events."""
    ends = {(v, d) for v, d in ix.home.items()}
    for e in events:
        ends |= set(ix.outs[(e[1], e[2])]) if e[0] == "run" else {(e[1], e[3])}
    outs = set(ix.outputs)
    return {(ix.values[v], ix.devices[d]) for v, d in ends if v in outs}


def extract(ix: HIndex, m: pyo.ConcreteModel, x: np.ndarray, info: SolveResult) -> Plan:
    """Stage by stage: the copies, then each part that runs (its steps without frees); unread computes and copies
    pruned, frees placed after last reads, then replayed by the simulator under the budgets."""
    nr, ns = len(m.R), len(m.S)
    on = lambda keys, xs: {k for k, val in zip(keys, xs) if val > 0.5}  # noqa: E731
    r_on = on(list(m.R.keys()), x[:nr])
    s_on = on(list(m.S.keys()), x[nr : nr + ns])
    c_on = on(list(m.C.keys()), x[nr + ns :])
    steps = plan_steps(ix, r_on, c_on)
    ends = {(ix.values[v], ix.devices[d]) for v, d, t in s_on if t == ix.T and v in set(ix.outputs)}
    ends |= {(ix.values[v], ix.devices[d]) for v, _, d, t in c_on if t == ix.T}
    ends |= {(ix.values[v], ix.devices[d]) for v, d in ix.home.items() if v in set(ix.outputs)}
    return finish_plan(ix.graph, ix.profile, steps, ix.budgets, ix.homes, ends, info)


def plan_steps(ix: HIndex, r_on: set, c_on: set) -> list[Step]:
    runs: dict[int, list[tuple[int, int]]] = {}
    for k, o, t in r_on:
        runs.setdefault(t, []).append((k, o))
    copies: dict[int, list[tuple[int, int, int]]] = {}
    for v, s_, d, t in c_on:
        copies.setdefault(t, []).append((v, s_, d))
    steps: list[Step] = []
    for t in range(ix.T + 1):
        moved = [Copy(ix.values[v], ix.devices[s_], ix.devices[d]) for v, s_, d in _chain_order(copies.get(t, ()))]
        steps += moved
        rank = {k: i for i, k in enumerate(ix.r_at.get(t, ()))}
        for k, o in sorted(runs.get(t, ()), key=lambda r: (rank[r[0]], r[1])):
            steps += part_steps(ix, ix.parts[k][o])
        # a value parked on a store at the start of the stage is resident on its source to the stage's end in the
        # model: its free there (finish_plan keeps it, unless the value is read later) lets the stage's computes
        # run while it moves
        steps += [Free(c.value, c.src) for c in moved if c.dst in ix.profile.stores]
    return steps


def _chain_order(copies: Sequence[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """A stage's copies (value, src, dst) sorted, but a copy from where another of the stage brings its value after
    that one (a chain of links: direct_plan's relays)."""
    left, out = sorted(copies), []
    while left:
        ready = [c for c in left if not any(o[0] == c[0] and o[2] == c[1] for o in left)] or left
        out += ready
        left = [c for c in left if c not in ready]
    return out


def finish_plan(
    graph,
    profile: Profile,
    steps: Sequence[Step],
    budgets: Mapping[str, int],
    homes: Mapping[str, str],
    ends: set[tuple[str, str]],
    info: SolveResult,
) -> Plan:
    """Steps pruned, frees placed (a parked value's where its block's schedule has it, when that plan is valid
    within the budgets; else after its last read too), simulated under the budgets (an error here is a bug of the
    memory model); then its copies home issued as their values are made where that fits and is faster, as the
    heuristics' (routing.with_early_homes): placed at the end, they queue behind the home's last free."""

    def again(moved: Sequence[Step]) -> Plan:
        return replace(finish(graph, moved, "hier", budgets, homes, profile, 0.0), solver=info)

    return with_early_homes(graph, _placed(graph, profile, steps, budgets, homes, ends, info), homes, profile, again)


def _placed(graph, profile, steps, budgets, homes, ends, info) -> Plan:
    steps = prune(graph, steps, ends)
    placed = place_frees(graph, steps, homes)
    kept = with_kept_frees(graph, steps, placed, profile)
    if kept != list(placed):
        try:
            return _checked(graph, profile, kept, budgets, homes, ends, info)
        except XschedError:
            pass  # a parked value held where the level above did not count it: freed after its copy out instead
    return _checked(graph, profile, placed, budgets, homes, ends, info)


def _checked(
    graph,
    profile: Profile,
    placed: Sequence[Step],
    budgets: Mapping[str, int],
    homes: Mapping[str, str],
    ends: set[tuple[str, str]],
    info: SolveResult,
) -> Plan:
    steps = hold_to_boundary(graph, free_unwanted_ends(graph, placed, homes, ends))
    plan = Plan(
        graph.fingerprint, dict(budgets), dict(homes), tuple(steps), info, boundary=autograd_boundary(graph, steps)
    )
    return predicted_plan(graph, plan, profile, "a flattened hierarchical plan")


def direct_plan(ix: HIndex, choice: Sequence[int], budgets: Mapping[str, int] | None = None) -> Plan:
    """Every block once in stage order with option `choice[block]` (forward and backward parts alike), each read
    not yet resident copied in from the device where the copy is cheapest: no solver, no recomputation. Checked
    against `budgets` (none by default)."""
    resident = {(v, d) for v, d in ix.home.items()}
    r_on, c_on = set(), set()

    def bring(v: int, d: int, t: int) -> None:
        if (v, d) in resident:
            return
        held = [ix.devices[s] for s in ix.dev_range if (v, s) in resident]
        # the heuristics' routing: the cheapest direct link, else a chain through the other devices, else not found
        for src, dst in copy_chain(ix.values[v], held, ix.devices[d], ix.graph, ix.profile, ix.devices, None):
            c_on.add((v, ix.devices.index(src), ix.devices.index(dst), t))
            resident.add((v, ix.devices.index(dst)))

    for t, (u, _) in enumerate(ix.units):
        o = choice[u]
        for v, d in ix.reads[(t, o)]:
            bring(v, d, t)
        r_on.add((t, o, t))
        resident.update(ix.outs[(t, o)])
    for v, d in ix.end_dev.items():
        bring(v, d, ix.T)
    ends = {(ix.values[v], ix.devices[d]) for v, d in resident if v in set(ix.outputs)}
    info = SolveResult("direct", "heuristic")
    return finish_plan(ix.graph, ix.profile, plan_steps(ix, r_on, c_on), budgets or {}, ix.homes, ends, info)
