"""HiGHS on the H-ILP (through the project's Pyomo hand-off), from a MIP start: the run's status, the watched
columns' values, objective and bound."""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import pyomo.environ as pyo

from xsched.solve.hier.hindex import HIndex
from xsched.solve.options import SolverOptions


@dataclass(frozen=True)
class HighsRun:
    """One HiGHS run of the H-ILP: its status, the watched columns' values (None without a solution), the model's
    objective and bound (None where unknown), and its seconds."""

    status: str
    x: np.ndarray | None
    objective: float | None
    bound: float | None
    solver_s: float


def run_highs(
    m: pyo.ConcreteModel, ix: HIndex, options: SolverOptions, t0: float, start: tuple[set, set] | None = None
) -> HighsRun:
    """HiGHS on the model until the time limit (from t0), from `start` (runs and copies; HiGHS completes the
    other variables or drops it): status, the watched columns' values, objective, bound."""
    from xsched.solve.milp.backends import set_threads, to_highs

    watched = [*m.R.values(), *m.S.values(), *m.C.values()]
    h, _, cols = to_highs(m, watched)
    if start is not None:
        runs, copies = start
        nr, ns = len(m.R), len(m.S)
        idx = [int(cols[i]) for i in range(nr)] + [int(cols[nr + ns + i]) for i in range(len(m.C))]
        val = [1.0 if k in runs else 0.0 for k in m.R.keys()] + [1.0 if k in copies else 0.0 for k in m.C.keys()]
        keep = [i for i, c in enumerate(idx) if c >= 0]
        h.setSolution(
            len(keep), np.array([idx[i] for i in keep], dtype=np.int32), np.array([val[i] for i in keep], dtype=float)
        )
    limit = options.time_limit_s if options.time_limit_s is not None else 3600.0
    h.setOptionValue("time_limit", max(0.05, limit - (time.perf_counter() - t0)))
    h.setOptionValue("mip_rel_gap", float(options.mip_gap))
    h.setOptionValue("output_flag", bool(options.verbose))
    set_threads(h, 1)
    h.setOptionValue("random_seed", int(options.seed))
    if options.node_limit is not None:
        h.setOptionValue("mip_max_nodes", int(options.node_limit))
    t1 = time.perf_counter()
    h.run()
    import highspy

    kind = highspy.HighsModelStatus
    said = {
        kind.kOptimal: "optimal",
        kind.kTimeLimit: "time_limit",
        kind.kInfeasible: "infeasible",
        kind.kUnboundedOrInfeasible: "infeasible",
    }
    status = said.get(h.getModelStatus(), "feasible")
    if status == "infeasible":  # HiGHS 1.16's presolve wrongly proves some H-ILPs infeasible (a 5-stage one in
        # tests/test_hier.py): a proof counts only when the model without presolve agrees in the time left
        h.setOptionValue("presolve", "off")
        h.setOptionValue("time_limit", max(0.05, limit - (time.perf_counter() - t0)))
        h.run()
        status = said.get(h.getModelStatus(), "feasible")
        status = "time_limit" if status == "feasible" and h.getInfo().primal_solution_status != 2 else status
    info = h.getInfo()
    x = None
    if info.primal_solution_status == 2:
        x = np.append(np.asarray(h.getSolution().col_value), 0.0)[cols]
    bound = info.mip_dual_bound if np.isfinite(info.mip_dual_bound) else None
    objective = info.objective_function_value if x is not None else None
    return HighsRun(status, x, objective, bound, time.perf_counter() - t1)
