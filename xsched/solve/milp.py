"""The multi-device rematerialization MILP: Checkmate's stages on several devices with explicit copies (XEngine's
formulation, linearised), built in Pyomo, solved by HiGHS (or another Pyomo solver), extracted into a checked Plan."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import pyomo.environ as pyo

from xsched.budgets import format_bytes
from xsched.errors import BudgetError, XschedError
from xsched.graph import Graph
from xsched.plan import Plan, SolverInfo
from xsched.profile import Profile
from xsched.solve.extract import Solution, best_plan, extract, plan_to_solution
from xsched.solve.options import SolverOptions
from xsched.solve.stages import Stages, index_stages

DEFAULT_OPTIONS = SolverOptions()  # frozen: one shared default
HIGHS_OPTIONS: dict[str, object] = {}  # extra HiGHS options for every solve (experiments, tuning)
# LP-guided restricted searches before the full one: (producer levels around the LP's recomputes, share of the
# time left); () searches the full model only
RESTRICTED: tuple[tuple[int, float], ...] = ((0, 0.25), (1, 0.5))
LP_SHARE = 0.25  # share of the time left for the LP relaxation that guides the restricted searches
EXTRACT_RESERVE = 0.05  # share of the time limit (at most 1 s) left for HiGHS's overrun and the extraction
LP_SUPPORT = 1e-6  # a recompute the LP relaxation sets above this stays in the restricted models


class NoIncumbent(XschedError):
    """The solver stopped (time limit) before it found any plan within the budgets."""

    def __init__(self, message: str, **where: str | int | None) -> None:
        super().__init__(message, stage=str(where.pop("stage", None) or "solve"), **where)  # type: ignore[arg-type]


def solve_milp(
    graph: Graph,
    profile: Profile,
    budgets: Mapping[str, int],
    devices: Sequence[str],
    homes: Mapping[str, str],
    options: SolverOptions = DEFAULT_OPTIONS,
    warm_start: Plan | None = None,
) -> Plan:
    """The best plan the MILP finds within `options.time_limit_s` (wall time from the call, model building
    included; HiGHS gets what is left), extracted and checked by the simulator.

    Raises BudgetError when the solver proves that no plan of the formulation meets the budgets, and
    NoIncumbent when it stops before finding any.
    """
    t0 = time.perf_counter()
    profile.check_graph(graph.fingerprint)
    devices = tuple(devices)
    budgets = {d: int(budgets[d]) for d in devices if d in budgets}
    try:
        from xsched.solve.bounds import check_budgets
    except ImportError:  # the pre-check is optional: the MILP proves infeasibility itself
        check_budgets = None
    if check_budgets is not None:
        check_budgets(graph, profile, budgets, devices, homes)
    st = index_stages(graph, profile, budgets, devices, homes, options)
    model = build_model(st, options)
    build_s = time.perf_counter() - t0
    start = plan_to_solution(st, warm_start) if warm_start is not None else None
    if start is not None:
        set_start(model, st, start)
    floor = sum(min(c.time_s for d in devices if (c := profile.op_cost(o.id, d)) is not None) for o in graph.ops)

    plans: dict[Solution, Plan] = {}  # incumbents extracted while the solver runs, reused when picking the best

    def at_floor(sol: Solution) -> bool:  # a plan as fast as every op run once at its fastest is optimal
        if options.alpha_energy != 0:
            return False
        if sol not in plans:
            plans[sol] = extract(st, sol, SolverInfo("milp"))
        return (plans[sol].predicted.time_s or 0.0) <= floor * (1 + 1e-9)

    if options.solver == "highs":
        limit = options.time_limit_s
        # HiGHS stops a little late on big models and the incumbents are extracted after it: keep a reserve
        deadline = t0 + limit - min(EXTRACT_RESERVE * limit, 1.0) if limit is not None else float("inf")
        out = _solve_highs(model, st, options, start is not None, at_floor, deadline)
    else:
        out = _solve_pyomo(model, st, options, start is not None)
    if out["status"] == "infeasible":
        per_device = ", ".join(
            f"{d}: {format_bytes(budgets[d])}" if d in budgets else f"{d}: unlimited" for d in devices
        )
        raise BudgetError(
            f"the MILP proves that no plan meets the budgets ({per_device})",
            stage="solve",
            device=devices[0] if len(devices) == 1 else None,
        )
    if not out["solutions"]:
        raise NoIncumbent(f"{options.solver} stopped ({out['status']}) after {out['solver_s']:.1f} s without a plan")
    extra = {
        "build_s": build_s,
        "handoff_s": out["handoff_s"],
        "highs_s": out["solver_s"],
        "milp_objective": out["objective"] * st.tu if out["objective"] is not None else None,
        "milp_bound": out["bound"] * st.tu if out["bound"] is not None else None,
        "n_binaries": len(model.R) + len(model.S) + len(model.C) + len(model.H),
        "n_constraints": sum(len(c) for c in model.component_objects(pyo.Constraint, active=True)),
        "incumbents": len(out["solutions"]),
        "warm_start": warm_start.solver.method if warm_start is not None else None,
        "warm_start_mapped": start is not None,  # False: the plan's first computes are not in graph order
        "stopped_at_floor": bool(out.get("at_floor")),  # an incumbent's plan ran every op once at its fastest
        "incumbent_s": [round(x - t0, 3) for x in out.get("found_at", ())],  # when each solution came, from the call
    }
    gap = 0.0 if out.get("at_floor") else _gap(out["objective"], out["bound"])
    return best_plan(st, out["solutions"], out["status"], gap, t0, extra, options.alpha_energy, plans)


def _gap(objective: float | None, bound: float | None) -> float | None:
    if objective is None or bound is None:
        return None
    return max(0.0, objective - bound) / max(abs(objective), 1e-12)


# ---------------------------------------------------------------- the model
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

    def s(d: int, t: int, v: int):  # noqa: ANN202 - residency at the start of stage t: a variable, 1 or 0
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
    run_time = sum(st.time[d][i] * R[d, t, i] for d, t, i in st.r_keys) + sum(st.copy_time[k] * C[k] for k in st.c_keys)
    alpha = options.alpha_energy * st.eu / st.tu  # objective in time units: time + alpha * energy
    m.obj = pyo.Objective(expr=run_time + alpha * energy if alpha else run_time, sense=pyo.minimize)
    m.u_defs = u_defs
    return m


def set_start(m: pyo.ConcreteModel, st: Stages, sol: Solution) -> None:
    """Give every variable its value under `sol` (a MIP start): frees as late-as-allowed, U by its recursion."""
    for group, on in ((m.R, sol.r_on), (m.S, sol.s_on), (m.C, sol.c_on), (m.H, sol.h_on)):
        for k in group:
            group[k].set_value(1 if k in on else 0)
    for key in st.f_keys:
        d, t, v, k = key
        kept = st.home.get(v) == d or (d, t + 1, v) in sol.s_on or (v, d) in sol.h_on
        later = any(k < j <= t and (d, t, j) in sol.r_on for j in st.users[v])
        m.F[key].set_value(1 if (d, t, k) in sol.r_on and not kept and not later else 0)
    for u, rhs in m.u_defs:  # in chain order: each right-hand side reads only U values already set
        u.set_value(pyo.value(rhs), skip_validation=True)


# ---------------------------------------------------------------- solvers
def _watched(m: pyo.ConcreteModel) -> list:
    return [*m.R.values(), *m.S.values(), *m.C.values(), *m.H.values()]


def _solution(st: Stages, m: pyo.ConcreteModel, x: np.ndarray) -> Solution:
    nr, ns, nc = len(m.R), len(m.S), len(m.C)
    pick = lambda keys, xs: frozenset(k for k, val in zip(keys, xs) if val > 0.5)  # noqa: E731
    return Solution(
        r_on=pick(list(m.R.keys()), x[:nr]),
        s_on=pick(list(m.S.keys()), x[nr : nr + ns]),
        c_on=pick(list(m.C.keys()), x[nr + ns : nr + ns + nc]),
        h_on=pick(list(m.H.keys()), x[nr + ns + nc :]),
    )


def to_highs(m: pyo.ConcreteModel):  # noqa: ANN201 - (highspy.Highs, column of each watched variable or -1)
    """The model as one sparse matrix (Pyomo's standard-form compiler), passed to highspy in one call: a few
    times faster than appsi's per-constraint hand-off."""
    import highspy
    from pyomo.repn.plugins.standard_form import LinearStandardFormCompiler

    info = LinearStandardFormCompiler().write(m, mixed_form=True, set_sense=None)
    a = info.A.tocsc()
    sense = np.array([r.bound_type for r in info.rows], dtype=np.int8)  # 1: <=, -1: >=, 0: ==
    rhs, inf = np.asarray(info.rhs, dtype=float), highspy.kHighsInf
    cols = info.columns
    lower = np.array([-inf if v.lb is None else v.lb for v in cols], dtype=float)
    upper = np.array([inf if v.ub is None else v.ub for v in cols], dtype=float)
    h = highspy.Highs()
    h.setOptionValue("output_flag", False)  # the caller turns the log on
    h.passModel(
        len(cols), len(rhs), a.nnz, int(highspy.MatrixFormat.kColwise), int(highspy.ObjSense.kMinimize),
        float(info.c_offset[0]), info.c.toarray()[0].astype(float), lower, upper,
        np.where(sense <= 0, rhs, -inf), np.where(sense >= 0, rhs, inf),
        a.indptr.astype(np.int32), a.indices.astype(np.int32), a.data.astype(float),
        np.array([int(v.is_integer()) for v in cols], dtype=np.int32),
    )  # fmt: skip
    col = {id(v): k for k, v in enumerate(cols)}
    return h, cols, np.array([col.get(id(v), -1) for v in _watched(m)], dtype=np.int64)


def _restricted_off(
    st: Stages, m: pyo.ConcreteModel, cols: np.ndarray, x: np.ndarray, keep: np.ndarray, level: int
) -> list:
    """Columns to switch off in the restricted search: recomputes R[d,t,i] (i < t) at 0 in the LP relaxation `x`
    and in `keep` (except, `level` producers up, those of the inputs of an op kept in the same stage), and S[d,t,v]
    after the last stage where a kept compute reads v (keeping v longer can only cost memory)."""
    nr, ns = len(m.R), len(m.S)
    on = {k for k, c in zip(m.R.keys(), cols) if k[1] == k[2] or (c >= 0 and (x[c] > LP_SUPPORT or keep[c] > 0.5))}
    for _ in range(level):
        on |= {(d, t, st.prod[v]) for d, t, i in list(on) for v in st.ins[i] if st.prod[v] is not None}
    last = [-1] * len(st.mem)
    for _, t, i in on:
        for v in st.ins[i]:
            last[v] = max(last[v], t)
    ends = set(st.outputs) | set(st.free_home)
    off = [c for k, c in zip(m.R.keys(), cols[:nr]) if k not in on]
    off += [c for (d, t, v), c in zip(m.S.keys(), cols[nr : nr + ns]) if t > last[v] and v not in ends]
    return [c for c in off if c >= 0]


def _solve_highs(
    m: pyo.ConcreteModel, st: Stages, options: SolverOptions, warm: bool, enough: Callable, deadline: float
) -> dict:
    """HiGHS through highspy, keeping every improving incumbent (extraction often turns a worse one into a better
    plan); it stops as soon as `enough(solution)` says an incumbent's plan cannot be beaten.

    With RESTRICTED it first solves the LP relaxation, then searches models restricted to the recomputes the LP
    uses and the warm start's (and the producers around them), each for its share of the time left, then the full
    model from the best plan so far: a restricted model is a tenth of the size after presolve or less and finds
    good plans long before HiGHS's root node on the full one is done. When the LP takes more than LP_SHARE of the
    time, the restricted searches keep the recomputes of the first computes' inputs' producers instead.
    """
    import highspy

    t0 = time.perf_counter()
    h, columns, cols = to_highs(m)
    handoff_s = time.perf_counter() - t0
    h.setOptionValue("output_flag", bool(options.verbose))
    h.setOptionValue("mip_rel_gap", float(options.mip_gap))
    for key, val in {**HIGHS_OPTIONS, **({"threads": options.threads} if options.threads else {})}.items():
        h.setOptionValue(key, val)
    n = len(columns)
    x = np.array([float(v.value or 0.0) for v in columns]) if warm else None
    found: list[np.ndarray] = []
    found_at: list[float] = []
    objectives: list[float] = []
    stop: list[object] = []  # True, or the exception raised while judging an incumbent
    pad = lambda y: np.append(np.asarray(y), 0.0)[cols]  # noqa: E731 - a watched variable without a column is 0

    def on_improving(e) -> None:  # noqa: ANN001
        found.append(pad(e.data_out.mip_solution))
        found_at.append(time.perf_counter())
        objectives.append(e.data_out.objective_function_value)
        try:
            if enough(_solution(st, m, found[-1])):
                stop.append(True)
        except Exception as err:  # noqa: BLE001 - never raise into HiGHS; re-raised below
            stop.append(err)

    def on_interrupt(e) -> None:  # noqa: ANN001
        if stop:
            e.interrupt()

    def run(seconds: float, start: np.ndarray | None) -> None:
        h.setOptionValue("time_limit", max(seconds, 0.01))
        if start is not None:
            sol = highspy.HighsSolution()
            sol.col_value, sol.value_valid = start.tolist(), True
            h.setSolution(sol)
        h.run()

    h.cbMipImprovingSolution.subscribe(on_improving)
    h.cbMipInterrupt.subscribe(on_interrupt)
    kind, t1 = highspy.HighsModelStatus, time.perf_counter()
    lp_bound = None
    if RESTRICTED and any(i < t for _, t, i in m.R.keys()):
        integer = np.array([int(v.is_integer()) for v in columns], dtype=np.int32)
        every = np.arange(n, dtype=np.int32)
        h.changeColsIntegrality(n, every, np.zeros(n, dtype=np.int32))
        run(LP_SHARE * (deadline - time.perf_counter()), None)
        relaxed = h.getModelStatus()
        h.changeColsIntegrality(n, every, integer)
        if relaxed in (kind.kInfeasible, kind.kUnboundedOrInfeasible):  # the objective is bounded: infeasible
            return {"status": "infeasible", "solutions": [], "objective": None, "bound": None,
                    "handoff_s": handoff_s, "solver_s": time.perf_counter() - t1}  # fmt: skip
        levels = RESTRICTED
        if relaxed == kind.kOptimal:
            lp_bound = h.getInfo().objective_function_value
            lp_x = np.asarray(h.getSolution().col_value)
        else:  # the LP is too slow (big graphs): restrict around the first computes' own inputs instead
            lp_x, levels = np.zeros(n), tuple((lv, sh) for lv, sh in RESTRICTED if lv > 0)
        for level, share in levels:  # ever wider neighbourhoods of the LP's recomputes, each from the best so far
            off = np.array(_restricted_off(st, m, cols, lp_x, x if x is not None else np.zeros(n), level),
                           dtype=np.int32)  # fmt: skip
            h.changeColsBounds(len(off), off, np.zeros(len(off)), np.zeros(len(off)))
            run(share * (deadline - time.perf_counter()), x)
            if h.getInfo().primal_solution_status == 2:  # kSolutionStatusFeasible: the next run starts from it
                x = np.asarray(h.getSolution().col_value)
            h.changeColsBounds(len(off), off, np.zeros(len(off)), np.ones(len(off)))
            if stop:
                break
    full = not stop  # else the restricted run's plan is already as fast as any can be
    if full:
        run(deadline - time.perf_counter(), x)
    solver_s = time.perf_counter() - t1
    for y in stop:
        if isinstance(y, Exception):
            raise y
    ms, info = h.getModelStatus(), h.getInfo()
    status = {
        kind.kOptimal: "optimal",
        kind.kTimeLimit: "time_limit",
        kind.kInfeasible: "infeasible",
        kind.kUnboundedOrInfeasible: "infeasible",
    }.get(ms, "feasible")
    if stop and status != "infeasible":
        status = "optimal"
    has_final = info.primal_solution_status == 2
    sols = [_solution(st, m, y) for y in found]
    if has_final:
        sols.append(_solution(st, m, pad(h.getSolution().col_value)))
        found_at.append(time.perf_counter())
    bound = info.mip_dual_bound if full and np.isfinite(info.mip_dual_bound) else None
    if lp_bound is not None:
        bound = max(bound, lp_bound) if bound is not None else lp_bound
    return {
        "status": status,
        "at_floor": bool(stop),
        "solutions": sols,
        "found_at": found_at,
        "objective": info.objective_function_value if has_final else min(objectives, default=None),
        "bound": bound,
        "handoff_s": handoff_s,
        "solver_s": solver_s,
    }


# Option names of the time limit, relative gap and threads for solvers behind pyo.SolverFactory.
_OPTION_NAMES = {
    "gurobi": ("TimeLimit", "MIPGap", "Threads"),
    "cbc": ("seconds", "ratioGap", "threads"),
    "cplex": ("timelimit", "mipgap", "threads"),
    "glpk": ("tmlim", "mipgap", None),
    "scip": ("limits/time", "limits/gap", None),
    "appsi_highs": ("time_limit", "mip_rel_gap", "threads"),
}


def _solve_pyomo(m: pyo.ConcreteModel, st: Stages, options: SolverOptions, warm: bool) -> dict:
    """Any other Pyomo solver, through the legacy SolverFactory interface: the final incumbent only."""
    from pyomo.opt import TerminationCondition

    base = options.solver.split("_persistent")[0].split("_direct")[0]
    if base not in _OPTION_NAMES:
        raise XschedError(
            f"unsupported solver {options.solver!r}; known: highs, {', '.join(_OPTION_NAMES)}", stage="solve"
        )
    solver = pyo.SolverFactory(options.solver)
    if not solver.available(exception_flag=False):
        raise XschedError(f"solver {options.solver!r} is not installed", stage="solve")
    names = _OPTION_NAMES[base]
    opts = {names[1]: options.mip_gap}
    if options.time_limit_s is not None:
        opts[names[0]] = options.time_limit_s
    if options.threads and names[2]:
        opts[names[2]] = options.threads
    kw = {"warmstart": True} if warm and solver.warm_start_capable() else {}
    t0 = time.perf_counter()
    res = solver.solve(m, load_solutions=False, tee=options.verbose, options=opts, **kw)
    solver_s = time.perf_counter() - t0
    tc = res.solver.termination_condition
    if tc in (TerminationCondition.infeasible, TerminationCondition.infeasibleOrUnbounded):
        status = "infeasible"
    else:
        status = {TerminationCondition.optimal: "optimal", TerminationCondition.maxTimeLimit: "time_limit"}.get(
            tc, "feasible"
        )
    sols, objective, bound = [], None, None
    if len(res.solution) > 0:
        m.solutions.load_from(res)
        sols.append(_solution(st, m, np.array([v.value or 0.0 for v in _watched(m)])))
        objective, bound = pyo.value(m.obj), res.problem.lower_bound
        bound = bound if bound is not None and np.isfinite(bound) else None
    return {
        "status": status,
        "solutions": sols,
        "objective": objective,
        "bound": bound,
        "handoff_s": 0.0,
        "solver_s": solver_s,
    }


__all__ = ["NoIncumbent", "build_model", "solve_milp"]
