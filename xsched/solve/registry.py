"""The solver registry: method name -> `SolverEntry`; every backend as a `Solver` giving a typed `SolveResult`.

Adding a solver is one module with a function `(Problem, SolverOptions, warm start) -> SolveResult` (or a
plain-argument function returning a Plan, adapted here) and one `register(...)` call.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from xsched.contracts.plan import Plan
from xsched.errors import BudgetError, PlanError, XschedError
from xsched.solve.heuristics import HEURISTICS
from xsched.solve.options import SolverOptions
from xsched.solve.problem import Problem, SolverEntry, SolveResult, Times, first_order

SOLVERS: dict[str, SolverEntry] = {}
# auto's exact stage skips graphs above this (ops x devices); a hierarchical solver is meant to take them
EXACT_MAX_SIZE = 5000
# auto runs the hierarchical solver from this size on (ops x devices), before the portfolio, which starts from its
# plan; below it the flat solvers are exact and fast enough on their own
HIER_MIN_SIZE = 100


def register(entry: SolverEntry) -> SolverEntry:
    """Add (or replace) a method."""
    SOLVERS[entry.name] = entry
    return entry


def result_from_plan(method: str, plan: Plan) -> SolveResult:
    """A solver's Plan as a typed result: status and gap from `plan.solver`, objective, bound and times
    from the names the backends write in `plan.solver.extra`; the order from its steps."""
    info, x = plan.solver, plan.solver.extra
    status = info.status if info.status in ("optimal", "feasible", "time_limit", "heuristic") else "feasible"
    times = Times(
        float(x.get("build_s", 0.0)),
        float(x.get("solve_s", x.get("highs_s", info.solve_s)) or 0.0),
        float(x.get("extract_s", 0.0)),
    )
    objective = x.get("milp_objective", x.get("objective"))
    bound = x.get("milp_bound", x.get("bound"))
    return SolveResult(method, status, plan, objective, bound, info.gap, times, first_order(plan), extra=dict(x))


def _heuristic(name: str) -> Callable[[Problem, SolverOptions, Plan | None], SolveResult]:
    fn = HEURISTICS[name]

    def run(problem: Problem, options: SolverOptions, warm: Plan | None = None) -> SolveResult:
        t0 = time.perf_counter()
        try:
            plan = fn(*problem.args())
        except XschedError as e:  # does not fit: the error (op, device) goes with the result
            return SolveResult(
                name, "failed", message=e.detail, times=Times(solve_s=time.perf_counter() - t0), extra={"error": e}
            )
        return result_from_plan(name, plan)

    return run


def _exact(name: str, call: Callable[[Problem, SolverOptions, Plan | None], Plan]) -> Callable:
    """An exact backend: its plan as a result, its infeasibility proof as status "infeasible", running out of time
    without a plan as "no_incumbent"."""

    def run(problem: Problem, options: SolverOptions, warm: Plan | None = None) -> SolveResult:
        from xsched.solve.milp import NoIncumbent

        t0 = time.perf_counter()
        try:
            return result_from_plan(name, call(problem, options, warm))
        except BudgetError as e:
            status, err = "infeasible", e
        except NoIncumbent as e:
            status, err = "no_incumbent", e
        except PlanError:
            raise  # an invalid plan is a bug of the backend, never "no plan"
        except XschedError as e:  # a backend that stopped without a plan for another reason (the portfolio's)
            if e.stage != "solve":
                raise
            status, err = "no_incumbent", e
        return SolveResult(
            name, status, message=err.detail, times=Times(solve_s=time.perf_counter() - t0), extra={"error": err}
        )

    return run


def _milp(problem: Problem, options: SolverOptions, warm: Plan | None) -> Plan:
    from xsched.solve.milp import solve_milp

    return solve_milp(*problem.args(), options, warm_start=warm)


def _intervals(backend: str) -> Callable[[Problem, SolverOptions, Plan | None], Plan]:
    def call(problem: Problem, options: SolverOptions, warm: Plan | None) -> Plan:
        from xsched.solve.intervals import solve_intervals

        return solve_intervals(
            *problem.args(),
            options,
            backend=backend,
            warm_start=warm,
            seed=options.seed,
            workers=options.solver_threads or 0,
        )

    return call


def _portfolio(problem: Problem, options: SolverOptions, warm: Plan | None) -> Plan:
    from xsched.solve.portfolio import solve_portfolio

    return solve_portfolio(
        *problem.args(), options, warm_start=warm, seed=options.seed, workers=options.solver_threads or 0
    )


def _hier(problem: Problem, options: SolverOptions, warm: Plan | None) -> Plan:
    from xsched.solve.hier import solve_hier

    return solve_hier(*problem.args(), options, warm_start=warm)


for _name in HEURISTICS:
    register(SolverEntry(_name, _heuristic(_name), kind="heuristic", doc=(HEURISTICS[_name].__doc__ or "").strip()))
register(
    SolverEntry(
        "milp",
        _exact("milp", _milp),
        max_size=EXACT_MAX_SIZE,
        doc="the stage MILP (Checkmate's stages on several devices), HiGHS",
    )
)
register(
    SolverEntry(
        "intervals-highs",
        _exact("intervals-highs", _intervals("highs")),
        max_size=EXACT_MAX_SIZE,
        doc="the retention-interval model for one order, linearised, HiGHS",
    )
)
register(
    SolverEntry(
        "intervals-cpsat",
        _exact("intervals-cpsat", _intervals("cpsat")),
        max_size=EXACT_MAX_SIZE,
        requires="ortools",
        doc="the retention-interval model for one order, CP-SAT",
    )
)
register(
    SolverEntry(
        "portfolio",
        _exact("portfolio", _portfolio),
        max_size=EXACT_MAX_SIZE,
        doc="order search + CP-SAT + interval MILP + stage MILP sharing incumbents",
    )
)
register(
    SolverEntry(
        "hier",
        _exact("hier", _hier),
        doc="hierarchical decomposition (HiREmate's H-Partition and H-ILP, on several devices)",
    )
)
