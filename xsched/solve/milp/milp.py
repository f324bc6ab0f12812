"""The multi-device rematerialization MILP: Checkmate's stages on several devices with explicit copies (XEngine's
formulation, linearised), built in Pyomo, solved by HiGHS (or another Pyomo solver), extracted into a checked Plan."""

from __future__ import annotations

import time
from dataclasses import replace

import pyomo.environ as pyo

from xsched.budgets import format_bytes
from xsched.contracts.plan import Plan
from xsched.contracts.result import MilpStats, SolveResult, Times
from xsched.errors import BudgetError, NoIncumbent
from xsched.solve.bounds.memory import check_budgets
from xsched.solve.milp.backends import solve_highs, solve_pyomo
from xsched.solve.milp.extract import Solution, best_plan, extract, plan_to_solution
from xsched.solve.milp.stages import Stages, index_stages
from xsched.solve.objective import objective, objective_floor
from xsched.solve.options import DEFAULTS, SolverOptions
from xsched.solve.order.order import stage_proof_covers_every_plan
from xsched.solve.problem import Problem
from xsched.solve.registry import from_plan

EXTRACT_RESERVE = 0.05  # share of the time limit (at most 1 s) left for HiGHS's overrun and the extraction
# variables (with their constraints) Pyomo builds per second: 135,691 in 5.3 s for mlp_mixer (default scale) on the
# 2-core development machine. A limit shorter than the build is refused up front: the build cannot be interrupted,
# and `auto` handed its last member 0.1 s that it spent 13 s on
BUILD_RATE = 25_000


def solve_milp(problem: Problem, options: SolverOptions = DEFAULTS, warm_start: Plan | None = None) -> Plan:
    """The best plan the MILP finds within `options.time_limit_s` (wall time from the call, model building
    included; HiGHS gets what is left), extracted and checked by the simulator.

    Raises BudgetError when the solver proves that no plan of the formulation meets the budgets, and
    NoIncumbent when it stops before finding any.
    """
    t0 = time.perf_counter()
    graph, profile, devices, homes = problem.graph, problem.profile, tuple(problem.devices), problem.homes
    profile.check_graph(graph.fingerprint)
    budgets = {d: int(problem.budgets[d]) for d in devices if d in problem.budgets}
    check_budgets(graph, profile, budgets, devices, homes)  # fail fast, naming the device and op, before building
    st = index_stages(graph, profile, budgets, devices, homes, options)
    _check_build_time(st, options.time_limit_s, time.perf_counter() - t0)
    model = build_model(st, options)
    build_s = time.perf_counter() - t0
    start = plan_to_solution(st, warm_start) if warm_start is not None else None
    if start is not None:
        set_start(model, st, start)
    floor, _ = objective_floor(graph, profile, devices, homes, options.alpha_energy)

    plans: dict[Solution, Plan] = {}  # incumbents extracted while the solver runs, reused when picking the best

    def at_floor(sol: Solution) -> bool:  # a plan as good as the lower bound on every plan is optimal
        if sol not in plans:
            plans[sol] = extract(st, sol, SolveResult("milp", "feasible"))
        return objective(plans[sol], options.alpha_energy) <= floor * (1 + 1e-9)

    if options.solver == "highs":
        limit = options.time_limit_s
        # HiGHS stops a little late on big models and the incumbents are extracted after it: keep a reserve
        deadline = t0 + limit - min(EXTRACT_RESERVE * limit, 1.0) if limit is not None else float("inf")
        out = solve_highs(model, st, options, start is not None, at_floor, deadline)
    else:
        out = solve_pyomo(model, st, options, start is not None)
    if out.status == "infeasible":
        per_device = ", ".join(
            f"{d}: {format_bytes(budgets[d])}" if d in budgets else f"{d}: unlimited" for d in devices
        )
        raise BudgetError(
            f"the MILP proves that no plan meets the budgets ({per_device})",
            stage="solve",
            device=devices[0] if len(devices) == 1 else None,
        )
    if not out.solutions:
        raise NoIncumbent(f"{options.solver} stopped ({out.status}) after {out.solver_s:.1f} s without a plan")
    stats = MilpStats(
        model_objective=out.objective * st.tu if out.objective is not None else None,
        model_bound=out.bound * st.tu if out.bound is not None else None,
        n_binaries=len(model.R) + len(model.S) + len(model.C) + len(model.H),
        n_constraints=sum(len(c) for c in model.component_objects(pyo.Constraint, active=True)),
        handoff_s=out.handoff_s,
        incumbents=len(out.solutions),
        incumbent_s=tuple(round(x - t0, 3) for x in out.found_at),
        warm_start=warm_start.solver.method if warm_start is not None else None,
        warm_start_mapped=start is not None,
        stopped_at_floor=out.at_floor,
        model_status=out.status,
    )
    gap = 0.0 if out.at_floor else _gap(out.objective, out.bound)
    t_end = time.perf_counter()
    times = Times(build_s, out.solver_s, max(0.0, t_end - t0 - build_s - out.solver_s))
    bound = stats.model_bound
    plan = best_plan(st, out.solutions, out.status, gap, bound, times, stats, options.alpha_energy, plans)
    return plan if _covers_every_plan(problem, plan) else _against_floor(plan, floor)


# the registry's entry: its BudgetError is a proof (for plans that first compute the ops in graph order)
run = from_plan(solve_milp, proofs=True)


def _covers_every_plan(problem: Problem, plan: Plan) -> bool:
    """The model's bound holds for every plan: where its proof does (order.stage_proof_covers_every_plan: one device,
    whose stage objective counts each stage to its end, computes of two devices or a copy longer than its stage's
    computes; graph order the only order, else the frontier makes op t's first compute stage t's, and a plan with
    another first-compute order is outside the model: the 7 s plan of a model optimum of 8 s that pruning made by
    dropping a forced compute; tests/test_milp_claims.py), and the plan is inside the model (a bound above the plan
    shows it is not)."""
    bound, value = plan.solver.bound, plan.solver.objective
    within = bound is None or value is None or bound <= value + 1e-6 * max(abs(value), 1.0)
    return stage_proof_covers_every_plan(problem) and within


def _against_floor(plan: Plan, floor: float) -> Plan:
    """The result where the model's bound does not hold for every plan: "optimal" only at the lower bound on every
    plan, else "feasible" where the model was proven optimal (its own bound and gap stay in the stats); the gap is
    against that bound."""
    info = plan.solver
    gap = _gap(info.objective, floor)
    status = "optimal" if gap <= 1e-9 else "feasible" if info.status == "optimal" else info.status
    return replace(plan, solver=replace(info, status=status, bound=floor, gap=gap))


def _gap(objective: float | None, bound: float | None) -> float | None:
    if objective is None or bound is None:
        return None
    return max(0.0, objective - bound) / max(abs(objective), 1e-12)


# ---------------------------------------------------------------- the model
def _check_build_time(st: Stages, limit: float | None, spent: float) -> None:
    """NoIncumbent when the model's build alone, at BUILD_RATE, would outlast what is left of the time limit."""
    size = len(st.r_keys) + len(st.s_keys) + len(st.c_keys) + len(st.f_keys)
    if limit is not None and size / BUILD_RATE > limit - spent:
        raise NoIncumbent(
            f"the stage MILP's {size:,} variables take about {size / BUILD_RATE:.1f} s to build, more than the "
            f"{max(limit - spent, 0.0):.2f} s left of its time limit"
        )


def build_model(st: Stages, options: SolverOptions) -> pyo.ConcreteModel:
    """Variables and constraints over the sparse index sets of `st`; see Stages for the index meanings."""
    m = pyo.ConcreteModel(name="xsched_milp")
    # ---- variable groups
    m.R = pyo.Var(st.r_keys, domain=pyo.Binary)  # R[d,t,i]: op i is computed on device d in stage t
    m.S = pyo.Var(st.s_keys, domain=pyo.Binary)  # S[d,t,v]: value v is resident on d at the start of stage t
    m.C = pyo.Var(st.c_keys, domain=pyo.Binary)  # C[s,d,t,v]: v is copied s -> d at the start of stage t
    m.H = pyo.Var(st.h_keys, domain=pyo.Binary)  # H[v,d]: d is the home of graph input v (fix_homes=False)
    m.F = pyo.Var(st.f_keys, bounds=(0, 1))  # F[d,t,v,k]: v is freed on d after op k of stage t (where that matters)
    m.U = pyo.Var(st.r_keys, bounds=(0, None))  # U[d,t,k]: bytes on d while op k of stage t runs (memory units)
    R, S, C, H, F, U = m.R, m.S, m.C, m.H, m.F, m.U

    def s(d: int, t: int, v: int):  # residency at the start of stage t: a variable, 1 or 0
        if st.home.get(v) == d:
            return 1
        return S[d, t, v] if (d, t, v) in S else 0

    def arrive(d: int, t: int, v: int) -> list:
        return [C[k] for k in st.c_into.get((d, t, v), ())]

    def made(d: int, t: int, v: int) -> list:
        p = st.prod[v]
        return [R[d, t, p]] if p is not None and (d, t, p) in R else []

    # ---- constraint groups
    m.frontier = pyo.ConstraintList()  # stage t computes op t (for the first time) on at least one device
    for t in range(st.T):
        m.frontier.add(sum(R[d, t, t] for d in st.dev_range if (d, t, t) in R) >= 1)
    m.needs = pyo.ConstraintList()  # a compute reads each input resident, copied in, or computed before it in the stage
    for d, t, j in st.r_keys:
        for v in st.ins[j]:
            have = s(d, t, v)
            if isinstance(have, int) and have == 1:
                continue
            m.needs.add(R[d, t, j] <= sum([have, *arrive(d, t, v), *made(d, t, v)]))
    m.keep = pyo.ConstraintList()  # a value resident at stage t+1 was resident, copied in or computed in stage t
    for d, t, v in st.s_keys:
        if t > 0:
            m.keep.add(S[d, t, v] <= sum([s(d, t - 1, v), *arrive(d, t - 1, v), *made(d, t - 1, v)]))
    m.source = pyo.ConstraintList()  # a copy reads a value resident on its source at the stage start
    for k in st.c_keys:
        src, _, t, v = k
        have = s(src, t, v)
        if not isinstance(have, int):
            m.source.add(C[k] <= have)
    m.once = pyo.ConstraintList()  # at most one of: resident, copied in, recomputed (single-output op) per stage
    for (d, t, v), ks in st.c_into.items():
        terms = [s(d, t, v), *(C[k] for k in ks)]
        p = st.prod[v]
        if p is not None and len(st.outs[p]) == 1:
            terms += made(d, t, v)
        if len(terms) > 1:
            m.once.add(sum(terms) <= 1)
    m.ends = pyo.ConstraintList()  # every graph output is resident somewhere at the end, required homes there
    for v in st.outputs:
        end = {d: [s(d, st.T, v), *arrive(d, st.T, v)] for d in st.dev_range}
        m.ends.add(sum(x for d in st.dev_range for x in end[d]) >= 1)
        need = st.end_home.get(v)
        if isinstance(need, int):
            m.ends.add(sum(end[need]) >= 1)
        elif need is not None:  # ("var", p): the home of param/buffer p is a variable
            for d in st.dev_range:
                m.ends.add(sum(end[d]) >= H[need[1], d])
    m.held = pyo.ConstraintList()  # a held output on d at the boundary (kept, copied in or made there) stays to the end
    for v in st.held:
        b = st.boundary
        assert b is not None  # held outputs exist only with a backward
        for d in st.dev_range:
            at_boundary = [s(d, b, v), *arrive(d, b, v), *made(d, b, v)]
            if all(isinstance(x, int) for x in at_boundary):
                continue  # never there (or homed there: never freed)
            for x in at_boundary:  # each alone: a multi-output recompute may make it where it is resident
                m.held.add(s(d, b + 1, v) >= x)
            for t in range(b + 1, st.T):
                m.held.add(s(d, t + 1, v) >= s(d, t, v))
    m.homes = pyo.ConstraintList()  # a variable-home input has one home, starts there only, is never freed there
    for v in st.free_home:
        m.homes.add(sum(H[v, d] for d in st.dev_range) == 1)
        for d in st.dev_range:
            for t in range(st.s_lo[v], st.s_hi[v] + 1):
                m.homes.add((S[d, t, v] == H[v, d]) if t == 0 else (S[d, t, v] >= H[v, d]))
    m.free = pyo.ConstraintList()  # free v after op k only if k ran, v is freed once, and no later reader runs
    for (d, t, v), ks in st.f_of.items():
        fs = [F[d, t, v, k] for k in ks if (d, t, v, k) in F]
        for f, k in zip(fs, ks):
            m.free.add(f <= R[d, t, k])
        for a in range(1, len(ks)):  # freed at or before the a-th reader: the a-th and later ones do not run
            m.free.add(sum(fs[:a]) + R[d, t, ks[a]] <= 1)
        nxt = s(d, t + 1, v)  # a value freed in stage t is not kept into t+1 and is not at its (variable) home
        for kept in ([nxt] if not isinstance(nxt, int) else []) + ([H[v, d]] if v in st.h_values else []):
            m.free.add(sum(fs) + kept <= 1)
    m.K = pyo.Var(st.k_keys, domain=pyo.Binary)  # K[i,r]: random op i draws from RNG r (where devices span several)
    m.draws = pyo.ConstraintList()  # a random op runs in one RNG domain only, so recomputes replay its draws
    for i in dict.fromkeys(i for i, _ in st.k_keys):
        m.draws.add(sum(m.K[i, r] for r in st.rngs) <= 1)
    for d, t, i in st.r_keys:
        if (i, st.rng[d]) in m.K:
            m.draws.add(R[d, t, i] <= m.K[i, st.rng[d]])
    u_defs: list = []  # (U, its defining expression) in chain order, to evaluate a MIP start
    m.start_mem = pyo.ConstraintList()  # resident values + copies arriving fit the budget during the copies
    m.run_mem = (
        pyo.ConstraintList()
    )  # U chains through a stage: + outputs and workspace of op k, - its workspace and frees
    for d in st.dev_range:
        cap = st.budget[d]
        for t in range(st.T + 1):
            base = st.const_mem[d] + sum(st.mem[v] * S[d, t, v] for v in st.s_at.get((d, t), ()))
            base = base + sum(st.mem[k[3]] * C[k] for k in st.c_at.get((d, t), ()))
            if cap is not None and not isinstance(base, (int, float)):
                m.start_mem.add(base <= cap)
            prev = None
            for k in st.r_at.get((d, t), ()):
                rhs = base + st.work[d][k] * R[d, t, k]
                if prev is not None:
                    freed = sum(st.mem[v] * F[d, t, v, prev] for v in st.f_at.get((d, t, prev), ()))
                    rhs = U[d, t, prev] - st.ws[d][prev] * R[d, t, prev] - freed + st.work[d][k] * R[d, t, k]
                m.run_mem.add(U[d, t, k] == rhs)
                u_defs.append((U[d, t, k], rhs))
                if cap is not None:
                    U[d, t, k].setub(cap)
                prev = k
    energy = sum(st.energy[d][i] * R[d, t, i] for d, t, i in st.r_keys) + sum(
        st.copy_energy[k] * C[k] for k in st.c_keys
    )
    if options.energy_cap_j is not None:
        m.energy_cap = pyo.Constraint(expr=energy <= options.energy_cap_j / st.eu)  # total energy within the cap
    run_time = stage_times(m, st)
    alpha = options.alpha_energy * st.eu / st.tu  # objective in time units: makespan + alpha * energy
    m.obj = pyo.Objective(expr=run_time + alpha * energy if alpha else run_time, sense=pyo.minimize)
    m.u_defs = u_defs
    return m


def stage_times(m: pyo.ConcreteModel, st: Stages):
    """The makespan as the sum of stage times, each its busiest device or link: a device computes its ops of the
    stage, after the copies into it that those ops read (a copy read in its own stage cannot hide); a link carries
    its copies of the stage while the devices compute (a copy out, or a prefetch for a later stage, overlaps)."""
    R, C = m.R, m.C
    readers: dict[tuple, list] = {}  # copy key -> its readers' R in the copy's stage on its destination
    for k in st.c_keys:
        s, d, t, v = k
        readers[k] = [R[d, t, j] for j in st.users[v] if (d, t, j) in R]
    y_keys = [k for k, rs in readers.items() if rs]
    # ---- variable groups
    m.Z = pyo.Var(range(st.T + 1), bounds=(0, None))  # Z[t]: stage t's time
    m.Y = pyo.Var(y_keys, bounds=(0, 1))  # Y[s,d,t,v]: the copy is read on d in its own stage: d waits for it
    # ---- constraint groups
    m.read_in_stage = pyo.ConstraintList()  # Y is 1 where the copy and a reader of it run in the same stage
    for k in y_keys:
        for r in readers[k]:
            m.read_in_stage.add(m.Y[k] >= C[k] + r - 1)
    m.device_time = pyo.ConstraintList()  # a stage lasts at least its computes on a device and the copies they wait for
    for d in st.dev_range:
        for t in range(st.T):
            work = [st.time[d][i] * R[d, t, i] for i in st.r_at.get((d, t), ())]
            work += [st.copy_time[k] * m.Y[k] for k in st.c_at.get((d, t), ()) if k in m.Y]
            if work:
                m.device_time.add(m.Z[t] >= sum(work))
    m.link_time = pyo.ConstraintList()  # ... and at least the copies each link carries in it
    per_link: dict[tuple[int, int, int], list] = {}
    for k in st.c_keys:
        per_link.setdefault((k[0], k[1], k[2]), []).append(st.copy_time[k] * C[k])
    for (_, _, t), terms in per_link.items():
        m.link_time.add(m.Z[t] >= sum(terms))
    return sum(m.Z[t] for t in range(st.T + 1))


def set_start(m: pyo.ConcreteModel, st: Stages, sol: Solution) -> None:
    """Give every variable its value under `sol` (a MIP start): frees as late-as-allowed, U by its recursion."""
    for group, on in ((m.R, sol.r_on), (m.S, sol.s_on), (m.C, sol.c_on), (m.H, sol.h_on)):
        for k in group:
            group[k].set_value(1 if k in on else 0)
    for i, r in st.k_keys:
        m.K[i, r].set_value(1 if any(st.rng[d] == r and i == j for d, _, j in sol.r_on) else 0)
    for key in st.f_keys:
        d, t, v, k = key
        kept = st.home.get(v) == d or (d, t + 1, v) in sol.s_on or (v, d) in sol.h_on
        later = any(k < j <= t and (d, t, j) in sol.r_on for j in st.users[v])
        m.F[key].set_value(1 if (d, t, k) in sol.r_on and not kept and not later else 0)
    for u, rhs in m.u_defs:  # in chain order: each right-hand side reads only U values already set
        u.set_value(pyo.value(rhs), skip_validation=True)
    busy: dict[tuple, float] = {}  # (stage, device or link) -> its time under the start
    for d, t, i in sol.r_on:
        busy[(t, d)] = busy.get((t, d), 0.0) + st.time[d][i]
    for k in sol.c_on:
        s, d, t, v = k
        busy[(t, s, d)] = busy.get((t, s, d), 0.0) + st.copy_time[k]
        read = any((d, t, j) in sol.r_on for j in st.users[v])
        if k in m.Y:
            m.Y[k].set_value(1 if read else 0)
        if read:
            busy[(t, d)] = busy.get((t, d), 0.0) + st.copy_time[k]
    for k in m.Y:
        if k not in sol.c_on:
            m.Y[k].set_value(0)
    for t in m.Z:
        m.Z[t].set_value(max((x for key, x in busy.items() if key[0] == t), default=0.0))


__all__ = ["build_model", "run", "solve_milp"]
