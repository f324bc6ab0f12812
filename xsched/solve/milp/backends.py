"""Solver back ends for the MILP: HiGHS driven directly (one sparse hand-off, LP-guided restricted searches,
incumbent callbacks) and any other Pyomo solver by name."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pyomo.environ as pyo

from xsched.errors import XschedError
from xsched.solve.milp.extract import Solution
from xsched.solve.milp.stages import Stages
from xsched.solve.options import SolverOptions

LP_SUPPORT = 1e-6  # a recompute the LP relaxation sets above this stays in the restricted models


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


def new_highs():  # highspy.Highs
    """A HiGHS instance without its banner: HiGHS prints its copyright line to stdout when the process makes its
    first instance, before any option can be set, which would corrupt `--json` output; stdout is closed for that."""
    import highspy

    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 1)
            h = highspy.Highs()
    finally:
        os.dup2(saved, 1)
        os.close(saved)
    h.setOptionValue("output_flag", False)  # the caller turns the log on
    return h


_SCHEDULER_THREADS: list[int] = []  # the thread count HiGHS's process-wide scheduler was last started with


def set_threads(h, threads: int | None) -> None:
    """HiGHS's thread count for `h`'s next run (None or 0: HiGHS's default). HiGHS starts one scheduler per process
    with the count of its first run and refuses (kError, no solution) a later run that asks for another, so the
    scheduler is reset first when the count changes. Safe here: HiGHS runs one at a time in a process (parallel
    solves use processes)."""
    import highspy

    want = int(threads or 0)
    if _SCHEDULER_THREADS and _SCHEDULER_THREADS[0] != want:
        highspy.Highs.resetGlobalScheduler(True)
    _SCHEDULER_THREADS[:] = [want]
    if want:
        h.setOptionValue("threads", want)


def to_highs(m: pyo.ConcreteModel, watched: list | None = None):  # (highspy.Highs, columns, column of each watched)
    """The model as one sparse matrix (Pyomo's standard-form compiler), passed to highspy in one call: a few
    times faster than appsi's per-constraint hand-off. `watched`: the variables whose columns are returned
    (default the stage MILP's R, S, C, H)."""
    import highspy
    from pyomo.repn.plugins.standard_form import LinearStandardFormCompiler

    info = LinearStandardFormCompiler().write(m, mixed_form=True, set_sense=None)
    a = info.A.tocsc()
    sense = np.array([r.bound_type for r in info.rows], dtype=np.int8)  # 1: <=, -1: >=, 0: ==
    rhs, inf = np.asarray(info.rhs, dtype=float), highspy.kHighsInf
    cols = info.columns
    lower = np.array([-inf if v.lb is None else v.lb for v in cols], dtype=float)
    upper = np.array([inf if v.ub is None else v.ub for v in cols], dtype=float)
    h = new_highs()
    h.passModel(
        len(cols),
        len(rhs),
        a.nnz,
        int(highspy.MatrixFormat.kColwise),
        int(highspy.ObjSense.kMinimize),
        float(info.c_offset[0]),
        info.c.toarray()[0].astype(float),
        lower,
        upper,
        np.where(sense <= 0, rhs, -inf),
        np.where(sense >= 0, rhs, inf),
        a.indptr.astype(np.int32),
        a.indices.astype(np.int32),
        a.data.astype(float),
        np.array([int(v.is_integer()) for v in cols], dtype=np.int32),
    )
    col = {id(v): k for k, v in enumerate(cols)}
    watched = _watched(m) if watched is None else watched
    return h, cols, np.array([col.get(id(v), -1) for v in watched], dtype=np.int64)


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


@dataclass(frozen=True)
class BackendRun:
    """What a backend's run of the stage MILP gives, the same for every backend: its status, the incumbents (in the
    order found, the final one last) and when each came (perf_counter; HiGHS only), the model's objective and
    bound (None where unknown), the seconds to hand the model over and to solve it, and whether it stopped because
    an incumbent's plan cannot be beaten (`enough`, HiGHS only)."""

    status: str
    solutions: tuple[Solution, ...]
    objective: float | None
    bound: float | None
    handoff_s: float
    solver_s: float
    found_at: tuple[float, ...] = ()
    at_floor: bool = False


def solve_highs(
    m: pyo.ConcreteModel, st: Stages, options: SolverOptions, warm: bool, enough: Callable, deadline: float
) -> BackendRun:
    """HiGHS through highspy, keeping every improving incumbent (extraction often turns a worse one into a better
    plan); it stops as soon as `enough(solution)` says an incumbent's plan cannot be beaten.

    With options.restricted it first solves the LP relaxation, then searches models restricted to the recomputes the LP
    uses and the warm start's (and the producers around them), each for its share of the time left, then the full
    model from the best plan so far: a restricted model is a tenth of the size after presolve or less and finds
    good plans long before HiGHS's root node on the full one is done. When the LP takes more than options.lp_share of the
    time, the restricted searches keep the recomputes of the first computes' inputs' producers instead.
    """
    import highspy

    t0 = time.perf_counter()
    h, columns, cols = to_highs(m)
    handoff_s = time.perf_counter() - t0
    h.setOptionValue("output_flag", bool(options.verbose))
    h.setOptionValue("mip_rel_gap", float(options.mip_gap))
    set_threads(h, options.solver_threads)
    if options.node_limit is not None:
        h.setOptionValue("mip_max_nodes", int(options.node_limit))
    n = len(columns)
    x = np.array([float(v.value or 0.0) for v in columns]) if warm else None
    found: list[np.ndarray] = []
    found_at: list[float] = []
    objectives: list[float] = []
    stop: list[object] = []  # True, or the exception raised while judging an incumbent
    pad = lambda y: np.append(np.asarray(y), 0.0)[cols]  # noqa: E731 - a watched variable without a column is 0

    def on_improving(e) -> None:
        found.append(pad(e.data_out.mip_solution))
        found_at.append(time.perf_counter())
        objectives.append(e.data_out.objective_function_value)
        try:
            if enough(_solution(st, m, found[-1])):
                stop.append(True)
        except Exception as err:  # never raise into HiGHS; re-raised below
            stop.append(err)

    def on_interrupt(e) -> None:
        if stop:
            e.interrupt()

    def run(seconds: float, start: np.ndarray | None) -> None:
        h.setOptionValue("time_limit", max(seconds, 0.01) if np.isfinite(seconds) else highspy.kHighsInf)
        if start is not None:
            sol = highspy.HighsSolution()
            sol.col_value, sol.value_valid = start.tolist(), True
            h.setSolution(sol)
        h.run()

    h.cbMipImprovingSolution.subscribe(on_improving)
    h.cbMipInterrupt.subscribe(on_interrupt)
    kind, t1 = highspy.HighsModelStatus, time.perf_counter()
    lp_bound = None
    restricted = options.restricted
    if restricted and any(i < t for _, t, i in m.R.keys()):
        relaxed = None  # lp_share 0: no LP relaxation, the structural restriction at once
        if options.lp_share > 0:
            integer = np.array([int(v.is_integer()) for v in columns], dtype=np.int32)
            every = np.arange(n, dtype=np.int32)
            h.changeColsIntegrality(n, every, np.zeros(n, dtype=np.int32))
            run(options.lp_share * (deadline - time.perf_counter()), None)
            relaxed = h.getModelStatus()
            h.changeColsIntegrality(n, every, integer)
        if relaxed in (kind.kInfeasible, kind.kUnboundedOrInfeasible):  # the objective is bounded: infeasible
            return BackendRun("infeasible", (), None, None, handoff_s, time.perf_counter() - t1)
        levels = restricted
        if relaxed == kind.kOptimal:
            lp_bound = h.getInfo().objective_function_value
            lp_x = np.asarray(h.getSolution().col_value)
        else:  # the LP is too slow (big graphs): restrict around the first computes' own inputs instead
            lp_x, levels = np.zeros(n), tuple((lv, sh) for lv, sh in restricted if lv > 0)
        for level, share in levels:  # ever wider neighbourhoods of the LP's recomputes, each from the best so far
            off = np.array(
                _restricted_off(st, m, cols, lp_x, x if x is not None else np.zeros(n), level), dtype=np.int32
            )
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
    objective = info.objective_function_value if has_final else min(objectives, default=None)
    return BackendRun(status, tuple(sols), objective, bound, handoff_s, solver_s, tuple(found_at), bool(stop))


# Option names of the time limit, relative gap and threads for solvers behind pyo.SolverFactory.
_OPTION_NAMES = {
    "gurobi": ("TimeLimit", "MIPGap", "Threads"),
    "cbc": ("seconds", "ratioGap", "threads"),
    "cplex": ("timelimit", "mipgap", "threads"),
    "glpk": ("tmlim", "mipgap", None),
    "scip": ("limits/time", "limits/gap", None),
    "appsi_highs": ("time_limit", "mip_rel_gap", "threads"),
}


def solve_pyomo(m: pyo.ConcreteModel, st: Stages, options: SolverOptions, warm: bool) -> BackendRun:
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
    if options.solver_threads and names[2]:
        opts[names[2]] = options.solver_threads
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
    return BackendRun(status, tuple(sols), objective, bound, 0.0, solver_s)
