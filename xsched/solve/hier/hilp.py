"""H-ILP (HiREmate's hierarchical ILP, on several devices): one option per block part per stage, boundary values
kept, copied and freed, phantoms held from a block's forward part to its backward part; built in Pyomo, solved by
HiGHS through the project's hand-off, extracted into steps the simulator checks.

Memory: while a part runs, its own figures (`Part.points`) cover what it makes (boundary outputs from their making
on) less the boundary values it read for the last time that the level above frees after it (the correction terms);
boundary values are otherwise freed only after their last reader in a stage. The flattened plan frees every
residency after its last read, never later than the model assumes, so its peak stays within the model's figure
(the simulator confirms it for every plan).

Recomputation: a forward part may run again in a later stage (any option); a backward part only with a partial
option (a deferred gradient op, `region.deferrable`), after the stage's own part, to make a parameter's gradient
again late as the flat optimum does: its first run's copy is then freed at once.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence

import pyomo.environ as pyo

from xsched.contracts.plan import Plan
from xsched.contracts.profile import Profile
from xsched.contracts.result import HilpStats, SolveResult, Times
from xsched.errors import BudgetError, NoIncumbent, XschedError
from xsched.solve.hier.greedy import as_start, greedy_events
from xsched.solve.hier.hextract import event_ends, event_steps, extract, finish_plan
from xsched.solve.hier.highs import run_highs
from xsched.solve.hier.hindex import HIndex, Unit, index
from xsched.solve.hier.menu import fastest, leanest
from xsched.solve.options import SolverOptions, late_after, now, time_left

CHECK_EVERY = 200  # steps of the model's loops (a constraint or a few each) between two looks at the clock
# handing the built model to HiGHS (Pyomo's standard form) takes about this many times its build (1.35 on
# random_layered_n250's 16-stage H-ILP, 3.4 s after a 2.5 s build under load): not started when that is more than
# is left
HANDOFF_PER_BUILD = 1.5


class _Late(Exception):
    """The deadline passed while the model was being built: no time is left to solve it."""


def solve_hilp(
    graph,
    profile: Profile,
    units: Sequence[Unit],
    budgets: Mapping[str, int],
    devices: Sequence[str],
    homes: Mapping[str, str],
    fwd_out: Sequence[str],
    options: SolverOptions,
) -> Plan:
    """The fastest plan of the H-ILP within `options.time_limit_s`, simulator-checked under `budgets`.
    BudgetError when HiGHS proves the model infeasible (for these options and stages), NoIncumbent without a plan."""
    t0, clock = time.perf_counter(), now()
    limit = options.time_limit_s if options.time_limit_s is not None else 3600.0
    # lateness on the solve stage's clock: the runner's deadline for hier, or this model's own limit
    late = late_after(clock, limit)
    ix = index(graph, profile, units, budgets, devices, homes, fwd_out)
    events, start = _start(ix, units, late)  # first: its schedule is a plan of its own when the model gets none
    out, why = None, "the time limit came while it was being built"
    try:
        built = time.perf_counter()
        m = build_model(ix, options.alpha_energy, late)
        build_s = time.perf_counter() - t0
        handoff = HANDOFF_PER_BUILD * (time.perf_counter() - built)
        if handoff > min(time_left(), limit - (now() - clock)):
            why = f"handing it to HiGHS would take about {handoff:.1f} s, more than is left"
        else:
            out = run_highs(m, ix, options, t0, start)
    except _Late:
        pass
    if (out is None or out.x is None) and events:  # no plan from the model in time (it is stricter): the
        # schedule's may fit
        status = out.status if out is not None else "time_limit"
        stats = HilpStats(ix.T, start is not None, len(events), model_status=status)
        info = SolveResult("greedy", "heuristic", times=Times(solve_s=time.perf_counter() - t0), stats=stats)
        try:
            return finish_plan(graph, profile, event_steps(ix, events), budgets, homes, event_ends(ix, events), info)
        except XschedError:
            pass
    if out is None:
        raise NoIncumbent(f"the H-ILP of {graph.name} ({ix.T} stages) was not solved: {why}")
    if out.status == "infeasible":
        raise BudgetError(
            f"the H-ILP of {graph.name} ({ix.T} stages) has no plan within the budgets {dict(budgets)}", stage="solve"
        )
    if out.x is None:
        raise NoIncumbent(
            f"the H-ILP of {graph.name} ({ix.T} stages) found no plan in {time.perf_counter() - t0:.1f} s"
        )
    gap = None
    if out.objective is not None and out.bound is not None and out.objective > 0:
        gap = max(0.0, out.objective - out.bound) / out.objective
    stats = HilpStats(
        stages=ix.T,
        greedy_start=start is not None,
        greedy_events=len(events),
        n_binaries=len(m.R) + len(m.S) + len(m.C),
        model_objective=out.objective * ix.tu if out.objective is not None else None,
        model_bound=out.bound * ix.tu if out.bound is not None else None,
    )
    times = Times(build_s, out.solver_s, max(0.0, time.perf_counter() - t0 - build_s - out.solver_s))
    info = SolveResult("hilp", out.status, gap=gap, times=times, stats=stats)
    return extract(ix, m, out.x, info)


# ---------------------------------------------------------------- the model
def build_model(ix: HIndex, alpha: float = 0.0, late: Callable[[], bool] = lambda: False) -> pyo.ConcreteModel:
    """The H-ILP over `ix`; raises _Late when `late()` says so (looked at every CHECK_EVERY constraints and
    between constraint groups)."""
    m = pyo.ConcreteModel(name="xsched_hilp")
    tick = _ticker(late)
    T = ix.T
    c_into: dict[tuple[int, int, int], list] = {}
    for key in ix.c_keys:
        v, _, d, t = key
        c_into.setdefault((v, d, t), []).append(key)
    acts: dict[tuple[int, int, int], list[int]] = {}  # (v,d,t) -> stage-units reading or making it in stage t
    for t, ks in ix.r_at.items():
        for k in ks:
            for o in range(len(ix.parts[k])):
                for v, d in (*ix.reads[(k, o)], *ix.outs[(k, o)]):
                    lst = acts.setdefault((v, d, t), [])
                    if not lst or lst[-1] != k:
                        lst.append(k)
    f_keys = [(v, d, t, k) for (v, d, t), ks in acts.items() for k in ks if k != ix.r_at[t][-1]]
    freed_at: dict[tuple[int, int, int], list[int]] = {}  # (d,t,k) -> values that may be freed after k
    for v, d, t, k in f_keys:
        freed_at.setdefault((d, t, k), []).append(v)
    capped = [d for d in ix.dev_range if ix.budget[d] is not None]
    u_keys = [(d, t, k) for d in capped for t in range(T) for k in ix.r_at.get(t, ())]
    k_keys = [(k, c) for k, fits in ix.rng_class.items() for c in sorted({c for f in fits for c in f})]
    # ---- variable groups
    m.R = pyo.Var(ix.r_keys, domain=pyo.Binary)  # R[k,o,t]: stage-unit k runs with option o in stage t
    m.S = pyo.Var(ix.s_keys, domain=pyo.Binary)  # S[v,d,t]: boundary value v is resident on d when stage t starts
    m.C = pyo.Var(ix.c_keys, domain=pyo.Binary)  # C[v,s,d,t]: v is copied s -> d when stage t starts
    m.P = pyo.Var(ix.sp_keys, domain=pyo.Binary)  # P[k,o,t]: the phantom of forward k's option o is held at t
    m.F = pyo.Var(f_keys, bounds=(0, 1))  # F[v,d,t,k]: v is freed on d after stage-unit k of stage t
    m.U = pyo.Var(u_keys, bounds=(0, None))  # U[d,t,k]: bytes on d while stage-unit k runs in stage t
    m.K = pyo.Var(k_keys, domain=pyo.Binary)  # K[k,c]: forward k's runs all use options of RNG class c
    R, S, C, P, F, U = m.R, m.S, m.C, m.P, m.F, m.U

    def s(v: int, d: int, t: int):
        if ix.home.get(v) == d:
            return 1
        return S[v, d, t] if (v, d, t) in S else 0

    def arrive(v: int, d: int, t: int) -> list:
        return [C[k] for k in c_into.get((v, d, t), ())]

    rank = {t: {k: i for i, k in enumerate(ks)} for t, ks in ix.r_at.items()}

    def made(v: int, d: int, t: int, before: int | None = None) -> list:  # in stage t (before stage-unit `before`)
        p = ix.prod[v]
        if p is None or (before is not None and rank[t].get(p, len(rank[t])) >= rank[t][before]):
            return []
        return [R[p, o, t] for o in range(len(ix.parts[p])) if (v, d) in ix.outs[(p, o)] and (p, o, t) in R]

    def uses(k: int, v: int, d: int, t: int, outs: bool) -> list:
        return [
            R[k, o, t]
            for o in range(len(ix.parts[k]))
            if (k, o, t) in R and ((v, d) in ix.reads[(k, o)] or (outs and (v, d) in ix.outs[(k, o)]))
        ]

    # ---- constraint groups
    m.frontier = pyo.ConstraintList()  # stage t runs stage-unit t (first run) with exactly one option
    for t in range(T):
        m.frontier.add(sum(R[t, o, t] for o in range(len(ix.parts[t])) if (t, o, t) in R) == 1)
    m.needs = pyo.ConstraintList()  # a part's boundary reads are resident, copied in, or made earlier in the stage
    for k, o, t in ix.r_keys:
        tick()
        for v, d in ix.reads[(k, o)]:
            m.needs.add(R[k, o, t] <= sum([s(v, d, t), *arrive(v, d, t), *made(v, d, t, k)]))
    m.phantom = pyo.ConstraintList()  # a backward part needs its forward part's phantom of the same option
    for b, f in ix.twin.items():
        for o in range(len(ix.parts[b])):
            if (b, o, b) in R:
                m.phantom.add(
                    R[b, o, b] <= sum([P[f, o, b] if (f, o, b) in P else 0, R[f, o, b] if (f, o, b) in R else 0])
                )
    for f, o, t in ix.sp_keys:  # ... which only a run of the forward part makes
        m.phantom.add(P[f, o, t] <= sum([P[f, o, t - 1] if (f, o, t - 1) in P else 0, R[f, o, t - 1]]))
    m.keep = pyo.ConstraintList()  # resident at t+1: resident at t, copied in or made during t
    for v, d, t in ix.s_keys:
        tick()
        m.keep.add(S[v, d, t] <= sum([s(v, d, t - 1), *arrive(v, d, t - 1), *made(v, d, t - 1)] if t else [0]))
    m.source = pyo.ConstraintList()  # a copy reads a value resident on its source when the stage starts
    m.once = pyo.ConstraintList()  # resident or copied in, not both
    for v, src, d, t in ix.c_keys:
        tick()
        have = s(v, src, t)
        if not isinstance(have, int):
            m.source.add(C[v, src, d, t] <= have)
    for (v, d, t), cs in c_into.items():
        m.once.add(sum([s(v, d, t), *(C[k] for k in cs)]) <= 1)
    m.ends = pyo.ConstraintList()  # outputs resident at the end, on their required device; forward outputs at
    for v in ix.outputs:  # the first backward stage
        end = {d: [s(v, d, ix.T), *arrive(v, d, ix.T)] for d in ix.dev_range}
        m.ends.add(sum(x for d in ix.dev_range for x in end[d]) >= 1)
        if v in ix.end_dev:
            m.ends.add(sum(end[ix.end_dev[v]]) >= 1)
    if ix.t_back is not None:
        for v in ix.fwd_out:
            m.ends.add(sum(s(v, d, ix.t_back) for d in ix.dev_range) >= 1)
    m.held = pyo.ConstraintList()  # a held output on d when backward starts (kept, copied in, or made by a forward
    for v in ix.held:  # part run again in that stage, before the backward part) stays on d to the end
        b = ix.t_back
        assert b is not None  # held outputs are indexed only with a backward
        for d in ix.dev_range:
            made = [R[k, o, b] for (k, o), outs in ix.outs.items() if (v, d) in outs and (k, o, b) in R and k < b]
            at_back = [s(v, d, b), *arrive(v, d, b), *made]
            if all(isinstance(x, int) for x in at_back):
                continue  # never there (or homed there: never freed)
            for x in at_back:
                m.held.add(s(v, d, b + 1) >= x)
            for t in range(b + 1, ix.T):
                m.held.add(s(v, d, t + 1) >= s(v, d, t))
    m.draws = pyo.ConstraintList()  # every run of a block draws its random numbers from the same RNGs
    for k, fits in ix.rng_class.items():
        tick()
        m.draws.add(sum(m.K[k, c] for c in {c for f in fits for c in f}) <= 1)
        for kk in [k, *(b for b, f in ix.twin.items() if f == k)]:
            for o, f in enumerate(fits):
                for t in range(kk, ix.last[kk] + 1):
                    if (kk, o, t) in R:
                        m.draws.add(R[kk, o, t] <= sum(m.K[k, c] for c in f))
    tick(at_once=True)
    m.free = pyo.ConstraintList()  # free after k only if k used it, once, with no later reader in the stage
    for (v, d, t), ks in acts.items():
        tick()
        fs = [F[v, d, t, k] for k in ks if (v, d, t, k) in F]
        for k in ks:
            if (v, d, t, k) in F:
                m.free.add(F[v, d, t, k] <= sum(uses(k, v, d, t, True)))
        for a in range(1, len(ks)):
            before = [F[v, d, t, k] for k in ks[:a] if (v, d, t, k) in F]
            later = uses(ks[a], v, d, t, False)
            if before and later:
                m.free.add(sum(before) + sum(later) <= 1)
        if fs:
            nxt = s(v, d, t + 1)
            m.free.add(sum(fs) + (nxt if not isinstance(nxt, int) else 0) <= 1)
    tick(at_once=True)
    m.start_mem = pyo.ConstraintList()  # what is resident (values, copies arriving, phantoms) fits when t starts
    m.run_mem = pyo.ConstraintList()  # U[d,t,k]: bytes before k runs (U of the part before, + its lasting change,
    # - the values freed after it); + each of k's memory points, less the values it read last that are freed
    # after it (HiREmate's correction terms), within the budget
    s_at: dict[tuple[int, int], list[int]] = {}
    for v, d, t in ix.s_keys:
        s_at.setdefault((d, t), []).append(v)
    c_at: dict[tuple[int, int], list] = {}
    for key in ix.c_keys:
        c_at.setdefault((key[2], key[3]), []).append(key)
    p_at: dict[int, list] = {}
    for key in ix.sp_keys:
        p_at.setdefault(key[2], []).append(key)

    def gone(v: int, d: int, t: int, k: int):  # 1 when v is freed after stage-unit k of stage t (a lower bound)
        if k != ix.r_at[t][-1]:
            return F[v, d, t, k] if (v, d, t, k) in F else 0
        nxt = s(v, d, t + 1)
        return 1 - nxt

    for d in capped:
        cap = ix.budget[d]
        for t in range(T + 1):
            # terms of values of no bytes left out: Pyomo folds them to 0, and a sum of nothing but them is the
            # constant it refuses as trivially infeasible where the inputs homed on d exceed the budget alone
            base = ix.const[d] + sum(ix.mem[v] * S[v, d, t] for v in s_at.get((d, t), ()) if ix.mem[v])
            base = base + sum(ix.mem[key[0]] * C[key] for key in c_at.get((d, t), ()) if ix.mem[key[0]])
            base = base + sum(ix.phantom[f][o][d] * P[f, o, tt] for f, o, tt in p_at.get(t, ()) if ix.phantom[f][o][d])
            if not isinstance(base, (int, float)):
                m.start_mem.add(base <= cap)
            elif base > cap:
                raise BudgetError(f"the inputs homed on {ix.devices[d]} exceed its budget alone", stage="solve")
            prev = None
            for k in ix.r_at.get(t, ()):
                tick()
                rhs = (
                    base
                    if prev is None
                    else (
                        U[d, t, prev]
                        + sum(
                            ix.after[prev][o][d] * R[prev, o, t]
                            for o in range(len(ix.parts[prev]))
                            if ix.after[prev][o][d] and (prev, o, t) in R
                        )
                        - sum(ix.mem[v] * F[v, d, t, prev] for v in freed_at.get((d, t, prev), ()))
                    )
                )
                m.run_mem.add(U[d, t, k] == rhs)
                U[d, t, k].setub(cap)
                for o in range(len(ix.parts[k])):
                    if (k, o, t) not in R:
                        continue
                    for b, done in ix.points[k][o][d]:
                        m.run_mem.add(
                            U[d, t, k] + b * R[k, o, t] - sum(ix.mem[v] * gone(v, d, t, k) for v in done) <= cap
                        )
                prev = k
    tick(at_once=True)
    run_time = sum(ix.time[k][o] * R[k, o, t] for k, o, t in ix.r_keys)
    run_time = run_time + sum(ix.copy_time[key] * C[key] for key in ix.c_keys)
    if alpha:
        energy = sum(ix.energy[k][o] * R[k, o, t] for k, o, t in ix.r_keys)
        energy = energy + sum(ix.copy_energy[key] * C[key] for key in ix.c_keys)
        run_time = run_time + alpha * ix.eu / ix.tu * energy
    m.obj = pyo.Objective(expr=run_time, sense=pyo.minimize)
    return m


def _ticker(late: Callable[[], bool]) -> Callable[..., None]:
    """A step counter that raises _Late when `late()`, asked every CHECK_EVERY steps (or at once: `at_once`)."""
    steps = 0

    def tick(at_once: bool = False) -> None:
        nonlocal steps
        steps += 1
        if (at_once or steps % CHECK_EVERY == 0) and late():
            raise _Late

    return tick


# ---------------------------------------------------------------- solving
def _start(ix: HIndex, units: Sequence[Unit], late: Callable[[], bool]) -> tuple[list, tuple[set, set] | None]:
    """The eviction schedule over blocks (fastest options first, then leanest) within the model's rules (a MIP
    start), else one outside them (a plan only), else none (also once `late()` says so)."""
    home = ix.devices[0]
    choices = [[pick(u.options, home) for u in units] for pick in (fastest, leanest)]
    for strict in (True, False):
        for choice in choices:
            events = greedy_events(ix, choice, strict, late)
            if events is not None:
                return events, as_start(events) if strict else None
    return [], None


__all__ = ["Unit", "build_model", "solve_hilp"]
