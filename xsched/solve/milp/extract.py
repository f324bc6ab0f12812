"""Between MILP solutions and plans: steps from stage variables (pruned, frees placed, simulator-checked), and
stage variables from a plan (a MIP start)."""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

from xsched.contracts.graph import Graph
from xsched.contracts.plan import Compute, Copy, Free, Plan, Step, autograd_boundary, place_frees
from xsched.contracts.result import MilpStats, SolveResult, Times
from xsched.simulate import predicted_plan
from xsched.solve.autograd_boundary import hold_to_end
from xsched.solve.milp.stages import Stages
from xsched.solve.objective import better, objective


@dataclass(frozen=True)
class Solution:
    """The keys of the binary variables at 1: R[d,t,i], S[d,t,v], C[s,d,t,v], H[v,d] (see Stages)."""

    r_on: frozenset
    s_on: frozenset
    c_on: frozenset
    h_on: frozenset


def homes_of(st: Stages, sol: Solution) -> dict[str, str]:
    """Graph input -> home: the fixed ones, and the solver's pick for the movable ones."""
    homes = dict(st.homes)
    for v, d in sol.h_on:
        homes[st.graph.values[v].id] = st.devices[d]
    return homes


def wanted_at_end(st: Stages, sol: Solution) -> set[tuple[str, str]]:
    """(value, device) residencies the solution keeps at the end: outputs resident or copied there in stage T."""
    ends = {(v, d) for d, t, v in sol.s_on if t == st.T} | {(v, d) for _, d, t, v in sol.c_on if t == st.T}
    ends |= {(v, d) for v, d in st.home.items() if v in st.outputs}
    return {(st.graph.values[v].id, st.devices[d]) for v, d in ends if v in st.outputs}


def stage_steps(st: Stages, sol: Solution) -> list[Step]:
    """Per stage: its copies, then its computes in op order (devices in the given order for the same op)."""
    ops, vals, devs = st.graph.ops, st.graph.values, st.devices
    steps: list[Step] = []
    copies = sorted(sol.c_on, key=lambda k: (k[2], k[3], k[0], k[1]))
    computes = sorted(sol.r_on, key=lambda k: (k[1], k[2], k[0]))
    ci = ri = 0
    for t in range(st.T + 1):
        while ci < len(copies) and copies[ci][2] == t:
            s, d, _, v = copies[ci]
            steps.append(Copy(vals[v].id, devs[s], devs[d]))
            ci += 1
        while ri < len(computes) and computes[ri][1] == t:
            d, _, i = computes[ri]
            steps.append(Compute(ops[i].id, devs[d]))
            ri += 1
    return steps


def prune(
    graph: Graph, steps: Sequence[Step], wanted_end: Iterable[tuple[str, str]], kept: Collection[int] = ()
) -> list[Step]:
    """Drop computes and copies none of whose results is read before it is remade or needed at the end.

    Repeats until stable (a dropped step reads nothing any more); keeps one compute of every op, and the steps
    whose id() is in `kept` (what the caller needs for another reason: a forward output held at the boundary).
    """
    steps = list(steps)
    wanted = list(wanted_end)
    while True:
        used = [id(s) in kept for s in steps]
        maker: dict[tuple[str, str], int] = {}
        for i, s in enumerate(steps):
            if isinstance(s, Compute):
                op = graph.op[s.op]
                for v in op.inputs:
                    if (v, s.device) in maker:
                        used[maker[(v, s.device)]] = True
                for v in op.outputs:
                    maker[(v, s.device)] = i
            elif isinstance(s, Copy):
                if (s.value, s.src) in maker:
                    used[maker[(s.value, s.src)]] = True
                maker[(s.value, s.dst)] = i
        for key in wanted:
            if key in maker:
                used[maker[key]] = True
        count: dict[str, int] = {}
        for s in steps:
            if isinstance(s, Compute):
                count[s.op] = count.get(s.op, 0) + 1
        keep = [True] * len(steps)
        for i in reversed(range(len(steps))):  # the first compute of an op is the one kept when none is read
            s = steps[i]
            if used[i] or isinstance(s, Free) or (isinstance(s, Compute) and count[s.op] == 1):
                continue
            keep[i] = False
            if isinstance(s, Compute):
                count[s.op] -= 1
        if all(keep):
            return steps
        steps = [s for s, k in zip(steps, keep) if k]


def frees_after_stage(graph: Graph, steps: Sequence[Step]) -> list[Step]:
    """Each free that follows the copy that last read the value (a copy out) moved to the end of that copy's stage,
    after the stage's first compute of a new op: the stage model lets the copy run while the stage computes, and
    holds the value on its source meanwhile, so the computes need not wait for it."""
    out: list[Step] = []
    held: list[Free] = []
    seen: set[str] = set()  # ops computed so far: a stage ends with the first compute of an op
    last: Step | None = None
    for s in steps:
        if isinstance(s, Free) and isinstance(last, Copy) and last.value == s.value and last.src == s.device:
            held.append(s)
            continue
        out.append(s)
        if not isinstance(s, Free):
            last = s
        if isinstance(s, Compute) and s.op not in seen:
            seen.add(s.op)
            out += held
            held = []
    return out + held


def free_unwanted_ends(
    graph: Graph, steps: Sequence[Step], homes: Mapping[str, str], wanted_end: Iterable[tuple[str, str]]
) -> list[Step]:
    """place_frees keeps every residency of a graph output to the end; free those the solution does not keep."""
    outputs, wanted = set(graph.outputs), set(wanted_end)
    last: dict[tuple[str, str], int] = {}
    resident: set[tuple[str, str]] = set(homes.items())
    for i, s in enumerate(steps):
        if isinstance(s, Compute):
            for v in graph.op[s.op].inputs:
                last[(v, s.device)] = i
            for v in graph.op[s.op].outputs:
                resident.add((v, s.device))
                last[(v, s.device)] = i
        elif isinstance(s, Copy):
            last[(s.value, s.src)] = i
            resident.add((s.value, s.dst))
            last[(s.value, s.dst)] = i
        else:
            resident.discard((s.value, s.device))
    extra = sorted((last[k], k) for k in resident if k[0] in outputs and k not in wanted and homes.get(k[0]) != k[1])
    out = list(steps)
    for i, (v, d) in reversed(extra):
        out.insert(i + 1, Free(v, d))
    return out


def extract(st: Stages, sol: Solution, info: SolveResult) -> Plan:
    """The plan of one solution: stage steps, pruned, frees placed (none of a held output after the boundary),
    replayed by the simulator with the budgets."""
    graph = st.graph
    homes = homes_of(st, sol)
    ends = wanted_at_end(st, sol)
    steps = prune(graph, stage_steps(st, sol), ends)
    steps = free_unwanted_ends(graph, place_frees(graph, steps, homes), homes, ends)
    steps = frees_after_stage(graph, steps)
    plan = Plan(
        graph=graph.fingerprint,
        budgets=dict(st.budgets),
        homes=homes,
        steps=tuple(steps),
        solver=info,
        boundary=autograd_boundary(graph, steps),
    )
    plan = hold_to_end(graph, plan)  # the model keeps held outputs to the end; placing frees did not
    return predicted_plan(graph, plan, st.profile, "the extracted MILP plan")


def best_plan(
    st: Stages,
    solutions: Sequence[Solution],
    status: str,
    gap: float | None,
    bound: float | None,
    times: Times,
    stats: MilpStats,
    alpha: float = 0.0,
    extracted: Mapping[Solution, Plan] | None = None,
) -> Plan:
    """The extracted plan with the least objective among the solver's incumbents (`extracted`: plans of some of
    them, already extracted and checked), carrying the MILP's result."""
    best: Plan | None = None
    best_at = -1
    seen: set[Solution] = set()
    for k, sol in enumerate(solutions):
        if sol in seen:
            continue
        seen.add(sol)
        plan = (extracted or {}).get(sol) or extract(st, sol, SolveResult("milp", status))
        if better(plan, best, alpha):
            best, best_at = plan, k
    assert best is not None
    stats = replace(stats, extracted=len(seen), best_incumbent=best_at)
    info = SolveResult("milp", status, objective(best, alpha), bound, gap, times, stats)
    return replace(best, solver=info)


def plan_to_solution(st: Stages, plan: Plan) -> Solution | None:
    """Stage variables reproducing `plan` as far as the stage structure allows (None: it cannot).

    Stage t ends with the first compute of op t, and holds every compute and copy since the previous
    one; S is the residency before the first of them. A plan that does not fit the stages (a copy of a value
    made in its own stage, ...) gives an infeasible start, which the solver rejects.
    """
    g = st.graph
    dix = {d: k for k, d in enumerate(st.devices)}
    vix = {v.id: k for k, v in enumerate(g.values)}
    if plan.graph != g.fingerprint or any(d not in dix for d in plan.devices):
        return None
    resident = {(vix[v], dix[d]) for v, d in plan.homes.items() if v in vix}
    r_on, c_on, s_on = set(), set(), set()
    t, pending, snapshot = -1, [], set(resident)
    for step in plan.steps:
        if isinstance(step, Free):
            resident.discard((vix[step.value], dix[step.device]))
            continue
        if not pending:
            snapshot = set(resident)
        if isinstance(step, Copy):
            pending.append((dix[step.src], dix[step.dst], vix[step.value]))
            resident.add((vix[step.value], dix[step.dst]))
            continue
        i, d = g.op_index[step.op], dix[step.device]
        resident.update((v, d) for v in st.outs[i])
        if i <= t:
            pending.append((d, i))
            continue
        if i != t + 1:
            return None  # first computes out of graph order: no stage assignment
        t = i
        s_on.update((dd, t, v) for v, dd in snapshot)
        for x in pending:  # what prepares the first compute of op t belongs to stage t
            (c_on.add((x[0], x[1], t, x[2])) if len(x) == 3 else r_on.add((x[0], t, x[1])))
        pending = []
        r_on.add((d, t, i))
    trailing = {(x[2], x[1]) for x in pending if len(x) == 3}
    s_on.update((d, st.T, v) for v, d in resident - trailing)
    for x in pending:
        (c_on.add((x[0], x[1], st.T, x[2])) if len(x) == 3 else r_on.add((x[0], st.T - 1, x[1])))
    h_on = {(v, dix[plan.homes[g.values[v].id]]) for v in st.free_home if g.values[v].id in plan.homes}
    keys = set(st.r_keys), set(st.s_keys), set(st.c_keys)
    return Solution(frozenset(r_on & keys[0]), frozenset(s_on & keys[1]), frozenset(c_on & keys[2]), frozenset(h_on))
