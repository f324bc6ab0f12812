"""The one solver runner: registered members in order within one time limit, each warm-started from the best plan so
far, every candidate checked by the simulator and ranked by one objective (`objective.objective`), one lower bound,
and one typed result. `auto`, `portfolio` and a single method are configurations of it (`configuration`)."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace

from xsched.budgets import format_bytes
from xsched.contracts.plan import Plan
from xsched.contracts.result import MemberOutcome, MilpStats, RunStats, SolveResult, Times
from xsched.errors import BudgetError, NoIncumbent, NoLinkError, PlanError, SolverError, XschedError
from xsched.simulate import simulate
from xsched.solve.bounds.memory import check_budgets, lower_bounds
from xsched.solve.objective import better, objective, objective_floor
from xsched.solve.options import SolverOptions, deadline, enough_at, now, one_run, past_deadline
from xsched.solve.order.order import stage_proof_covers_every_plan
from xsched.solve.problem import Outcome, Problem, runnable
from xsched.solve.registry import IMPORT_S, SOLVERS, SolverEntry, run_member

CONFIGURATIONS = ("auto", "portfolio", "heuristics")
NO_LIMIT_S = 3600.0  # time_limit_s=None: an hour
MIN_MEMBER_S = 0.5  # a timed member is not started with less time left: building its model alone takes longer
MIN_METHOD_S = 1.0  # a method named on its own gets at least this much, even when the heuristics took the limit
# time for finding a budget that works after no plan was found: a share of the time left, at least PROBE_MIN_S
PROBE_SHARE, PROBE_MIN_S, PROBE_MAX_S = 0.2, 0.5, 10.0
FLOOR_SHARE = 0.1  # the lower bound's share of the limit (0.5-1.5 s on GPT-2 1.56B, most in its first LP)
GRACE_SHARE, GRACE_S = 0.1, 1.0  # a run returns within limit x (1 + GRACE_SHARE) + GRACE_S (issue 33)
PROBE_FACTORS = (1.1, 1.25, 1.5, 2.0, 4.0)  # budgets scaled by these until a heuristic fits
# a timed member's least share of the time left while no member has found a plan: the later members' shares are
# for improving a plan, and without one the first search to find any needs the time (GPT-2 on an H100 at 45%, GPU
# alone: only hier finds a plan, in 4-5 s of the 10 s the heuristics leave of 20, where 0.4 gave it 4.2 s)
NO_PLAN_SHARE = 0.75
_PROOF_SCOPE = {"milp": ", for plans that first compute the ops in graph order"}
# run again at the end on a timed member's plan (the heuristics' refiners saw only the heuristics' plans), in a
# share of the limit kept for it: GPT-2 at 25% with the store, park-search's 123.2 ms plan -> 121.4 ms in 0.3 s
POLISH, POLISH_SHARE = "keep-recomputes", 0.05


@dataclass(frozen=True)
class Configuration:
    """A run: `name` labels its result; `members` are registry names in order; `method`: a single method named by
    the user (the heuristics only warm-start it, and its own plan is returned unless it is worse than theirs)."""

    name: str
    members: tuple[str, ...]
    method: str | None = None


def configuration(name: str, problem: Problem) -> Configuration:
    """`auto`: every heuristic, then every registered search and exact model that fits the problem's size, in
    registration order; `portfolio`: the same without the hierarchical solver; `heuristics`: the heuristics alone
    (the best of them, in no time to speak of); a method's name: the heuristics as its warm start, then it."""
    heuristics = tuple(n for n, e in SOLVERS.items() if e.kind == "heuristic")
    timed = tuple(n for n, e in SOLVERS.items() if e.kind != "heuristic" and e.available() and e.fits(problem))
    if name == "auto":
        return Configuration("auto", heuristics + timed)
    if name == "portfolio":
        return Configuration("portfolio", heuristics + tuple(n for n in timed if n != "hier"))
    if name == "heuristics":
        return Configuration("heuristics", heuristics)
    if name not in SOLVERS:
        raise SolverError(f"unknown method {name!r}; choose one of {', '.join((*CONFIGURATIONS, *SOLVERS))}")
    entry = SOLVERS[name]
    if not entry.available():
        raise SolverError(f"method {name!r} needs {entry.requires}: pip install xsched[cpsat]")
    return Configuration(name, (name,) if entry.kind == "heuristic" else (*heuristics, name), method=name)


def run(problem: Problem, config: Configuration, options: SolverOptions, given: Plan | None = None) -> Outcome:
    """The best runnable plan of the configuration's members within `options.time_limit_s`, labelled with its
    status and gap against the lower bound; an Outcome without a plan when none is found (its record's `error` says
    whether no plan is *proven* or only *not found*)."""
    limit = options.time_limit_s if options.time_limit_s is not None else NO_LIMIT_S
    with one_run(limit):  # the run's limit and its members' units of work, for those after them (options.unit_s)
        return _run(problem, config, options, given)


def _run(problem: Problem, config: Configuration, options: SolverOptions, given: Plan | None) -> Outcome:
    """`run`'s body: the heuristics in their shares of the limit, then the timed members in what is left."""
    t0 = now()
    limit = options.time_limit_s if options.time_limit_s is not None else NO_LIMIT_S
    grace_end = limit * (1 + GRACE_SHARE) + GRACE_S  # the run returns by then (issue 33)
    alpha = options.alpha_energy
    # where an exact model's "optimal" is claimed: its proof covers every plan only on one device whose graph order
    # is the only order (where the run stops after it is a separate, looser question: _done)
    every = stage_proof_covers_every_plan(problem)
    try:
        check_budgets(problem.graph, problem.profile, problem.budgets, problem.devices, problem.homes)
    except NoLinkError as e:  # no budget brings the links the profile lacks: no budget to hint at or look for
        return _no_link(config, e)
    except BudgetError as e:
        return _no_plan(problem, config, f"proven infeasible ({e.detail.split('. Smallest')[0]})", None, limit, e)
    members = [SOLVERS[n] for n in config.members]
    timed = [e for e in members if e.kind != "heuristic"]
    best: Plan | None = None
    found: SolveResult | None = None  # the record of the member that found `best`
    outcomes: list[MemberOutcome] = []
    results: list[Outcome] = []  # the timed members', in order

    by: str | None = None  # the member whose plan `best` is

    def consider(name: str, r: Outcome, seconds: float) -> None:
        nonlocal best, found, by
        outcomes.append(_outcome(name, r, seconds))
        if better(r.plan, best, alpha):
            best, found, by = r.plan, r.record, name

    heuristics = [e for e in members if e.kind == "heuristic"]
    # the heuristics share the limit (less a named method's own minimum), each an equal part of what is left, so
    # that a slow one cannot starve those after it; one that ends early leaves its time to the rest
    until = limit - (MIN_METHOD_S if config.method is not None and timed else 0.0)
    floor, floor_why = _floor(problem, options, limit)
    enough = _gap_value(floor, options.mip_gap)  # a member's plan at or below it ends that member's search too
    for k, entry in enumerate(heuristics):
        started = now()
        if _within_gap(best, floor, alpha, options.mip_gap):  # no later member could gain more than the gap asked
            outcomes.append(MemberOutcome(entry.name, "no_incumbent", 0.0, None, "not started: a plan within the gap"))
            continue
        if entry.refines and best is None:  # alone it would make its own start: here, the heuristics before it failed
            outcomes.append(MemberOutcome(entry.name, "no_incumbent", 0.0, None, "not started: no plan to refine"))
            continue
        # without a plan each still tries its first variant (which runs however late), but only within the grace
        if started - t0 >= (until if best is not None else grace_end):
            outcomes.append(MemberOutcome(entry.name, "no_incumbent", 0.0, None, "not started: no time left"))
            continue
        share = max(until - (started - t0), 0.0) / (len(heuristics) - k)
        with deadline(share), enough_at(enough):  # the heuristic keeps it as its options.time_limit_s (keeps_limit)
            # the best plan so far, which only a member that `refines` reads
            r = run_member(entry, problem, replace(options, time_limit_s=share), best)
            stopped = past_deadline()
        consider(entry.name, _stopped(_checked(problem, r, options), stopped), now() - started)
    if given is not None:
        consider("warm start", _given(problem, given, options), 0.0)
    start = found
    polish = config.method is None and POLISH in config.members and bool(timed)
    reserve = POLISH_SHARE * limit if polish else 0.0
    for k, entry in enumerate(timed):
        left = limit - reserve - (now() - t0)
        if entry.name == config.method:  # a method named on its own runs, even after a heuristic at the floor
            left = max(left, MIN_METHOD_S)
        elif left < MIN_MEMBER_S or _done(best, found, results, floor, alpha, options.mip_gap):
            break
        elif left < MIN_MEMBER_S + (loading := _import_s(entry)):  # a later member may need no import
            why = f"not started: loading {', '.join(entry.imports)} (about {loading:g} s) leaves too little of {left:.2f} s"
            outcomes.append(MemberOutcome(entry.name, "no_incumbent", 0.0, None, why))
            continue
        started = now()
        member = _member_options(entry, options, left, timed[k + 1 :], planned=best is not None)
        with deadline(member.time_limit_s), enough_at(enough):  # what the member runs inside checks them too
            r = _checked(problem, run_member(entry, problem, member, best), options)
        results.append(r)
        consider(entry.name, r, now() - started)
    if polish and by in {e.name for e in timed} and limit - (now() - t0) > 0:
        started = now()
        left = limit - (started - t0)
        with deadline(left), enough_at(enough):
            r = _checked(
                problem, run_member(SOLVERS[POLISH], problem, replace(options, time_limit_s=left), best), options
            )
        consider(f"{POLISH} (last)", r, now() - started)
    seconds = now() - t0
    stats = RunStats(
        tuple(outcomes),
        warm_start=start.method if start is not None else None,
        warm_start_objective=start.objective if start is not None else None,
    )
    if config.method is not None:
        return _method_result(config.method, results, best, found, stats, seconds, alpha)
    if best is None:
        proofs = [r for r in results if r.status == "infeasible"]
        if proofs:
            scope = _PROOF_SCOPE.get(proofs[0].method, "")
            why = f"proven infeasible by {proofs[0].method} ({proofs[0].message}{scope})"
        else:
            tried = ", ".join(f"{o.method}: {o.status}" for o in outcomes)
            why = f"not found within the time limit ({limit:g} s; {tried})"
        proof = proofs[0] if proofs else None  # the probe for a budget that works takes what is left of the grace
        return _no_plan(problem, config, why, proof, limit - seconds, None, grace_end - seconds)
    return _labelled(config.name, best, found, results, (floor, floor_why), stats, options, seconds, every)


def _given(problem: Problem, given: Plan, options: SolverOptions) -> Outcome:
    """The caller's plan as a candidate, when it is for this graph and homes and meets the budgets."""
    if dict(given.homes) != dict(problem.homes):
        return Outcome(SolveResult("warm start", "failed", message="the given warm start has other homes"))
    try:
        return _checked(problem, Outcome(replace(given.solver, method="warm start"), given), options)
    except XschedError as e:  # over these budgets or not for this graph: not a candidate
        return Outcome(SolveResult("warm start", "failed", message=e.detail, error=e))


def _import_s(entry: SolverEntry) -> float:
    """What loading the member's heavy modules will take (IMPORT_S): nothing for those this process has loaded
    already. A member is not started unless the time left covers them and MIN_MEMBER_S."""
    return sum(IMPORT_S.get(m, 0.0) for m in entry.imports if m not in sys.modules)


def _member_options(
    entry: SolverEntry, options: SolverOptions, left: float, later: Sequence[SolverEntry], planned: bool = True
) -> SolverOptions:
    """A member's options: its share of the time left (all of it when it is the last timed member; at least
    NO_PLAN_SHARE while no plan is `planned`), and no refinement of its own plan by CP-SAT when a later member runs
    CP-SAT from it anyway."""
    if entry.kind == "heuristic":
        return options
    share = (entry.share if planned else max(entry.share, NO_PLAN_SHARE)) if later else 1.0
    return replace(options, time_limit_s=left * share, hier_refine=options.hier_refine and not later)


def _stopped(r: Outcome, stopped: bool) -> Outcome:
    """A heuristic's outcome as the clock left it: its plan "time_limit" (the best of what it tried), no plan
    "no_incumbent" (not a sign that none fits)."""
    if stopped and r.status == "heuristic":
        return Outcome(replace(r.record, status="time_limit"), r.plan)
    if stopped and r.status == "failed":
        return Outcome(replace(r.record, status="no_incumbent", message=f"stopped at the time limit: {r.message}"))
    return r


def _checked(problem: Problem, r: Outcome, options: SolverOptions) -> Outcome:
    """A member's result with its plan simulator-checked under the budgets and runnable through `wrap`; a plan
    over the budgets or the energy cap, or breaking the boundary rule, counts as no plan, so the incumbent it was
    warm-started from stays the best. A plan the simulator cannot run at any budget (a bug) propagates."""
    if r.plan is None:
        return r
    try:
        plan = runnable(problem.graph, r.plan, problem.profile, problem.budgets)
    except BudgetError as e:
        return Outcome(replace(r.record, status="failed", message=e.detail, error=e))
    except PlanError as e:
        simulate(problem.graph, r.plan, problem.profile, check_budgets=False)  # raises where it is a bug
        why = f"its plan exceeds the budgets: {e.detail}"
        return Outcome(replace(r.record, status="failed", message=why, error=e))
    if options.energy_cap_j is not None and (plan.predicted.energy_j or 0.0) > options.energy_cap_j:
        return Outcome(replace(r.record, status="failed", message="its plan exceeds the energy cap"))
    # the checked plan's own record: `validated` may have added the outputs it repaired
    return Outcome(replace(plan.solver, objective=objective(plan, options.alpha_energy)), plan)


def _done(best: Plan | None, found, results: list[Outcome], floor: float, alpha: float, gap: float) -> bool:
    """Nothing left worth the time: the best plan is within the relative `gap` (options.mip_gap, `--gap`) of the
    lower bound on every plan, the gap the result then reports as optimal, or the last member found it and its model
    proved it optimal in its formulation with the plan on one device (`_stops`)."""
    if _within_gap(best, floor, alpha, gap):
        return True
    return bool(results) and results[-1].record is found and _stops(found, best)


def _stops(r: SolveResult | None, plan: Plan | None) -> bool:
    """Where the run stops after an exact model (as before the claim was made sound, so auto's time is unchanged):
    its model proved the plan optimal (its own status, which the MILP keeps in its stats) and the plan runs on one
    device. A stop, not a claim: a plan outside the model (first computes out of graph order, or overlapping on a
    second device) may still beat it, and a later member might find that plan; stopping trades that chance for the
    time left (main's stop, kept so auto and the suite take no longer). The claim (`_proven`) is the stricter rule."""
    proved = r is not None and (r.status == "optimal" or _model_status(r) == "optimal")
    return _exact(r) and proved and plan is not None and len(plan.devices) == 1


def _within_gap(best: Plan | None, floor: float, alpha: float, gap: float) -> bool:
    """The plan's objective is within the relative `gap` of the lower bound on every plan (at it, for a gap of 0)."""
    return best is not None and _relative_gap(objective(best, alpha), floor) <= max(gap, 1e-9)


def gap_threshold(problem: Problem, options: SolverOptions) -> float:
    """The objective within `options.mip_gap` (`--gap`) of the lower bound on every plan, the bound found in its
    share of the limit: a heuristic run alone (xsched.solve.api) stops its variants there, as the runner's members do."""
    limit = options.time_limit_s if options.time_limit_s is not None else NO_LIMIT_S
    return _gap_value(_floor(problem, options, limit)[0], options.mip_gap)


def _floor(problem: Problem, options: SolverOptions, limit: float) -> tuple[float, str]:
    """The lower bound on every plan's objective and what sets it, found within its share of the limit."""
    with deadline(limit * FLOOR_SHARE):  # the phase bound's later cuts are left out past it (bounds.phases)
        return objective_floor(
            problem.graph, problem.profile, problem.devices, problem.homes, options.alpha_energy, problem.budgets
        )


def _gap_value(bound: float, gap: float) -> float:
    """The largest objective within the relative `gap` of `bound` (`_within_gap`'s test, solved for the value)."""
    return bound / (1.0 - max(gap, 1e-9)) if bound > 0 else 0.0


def _relative_gap(value: float, bound: float) -> float:
    """(objective - bound) / objective, the gap a result reports (0 at or below the bound)."""
    return max(0.0, value - bound) / value if value > 0 else 0.0


def _proven(r: SolveResult | None, every: bool) -> bool:
    """An exact model proved its plan optimal where its proof covers every plan (`every`: one device, graph order
    the only order). With a second device (computing or a store, budgeted or not) the stage objective
    over-estimates plans that overlap across its stages, and with a second topological order a plan whose first
    computes leave graph order is outside the stage model: either may beat the plan it proves optimal, so there
    only the floor on every plan proves a plan optimal."""
    return _exact(r) and r.status == "optimal" and every


def _model_status(r: SolveResult) -> str | None:
    """The model's own status where the result's says less (the stage MILP's, kept in its stats)."""
    return r.stats.model_status if isinstance(r.stats, MilpStats) else None


def _exact(r: SolveResult | None) -> bool:
    """The record is an exact model's (the registry's kind), whose "feasible" is a finished model, not a stop."""
    return r is not None and r.method in SOLVERS and SOLVERS[r.method].kind == "exact"


def _outcome(name: str, r: Outcome | None, seconds: float) -> MemberOutcome:
    if r is None:
        return MemberOutcome(name, "failed", seconds)
    obj = r.objective if r.plan is not None else None
    return MemberOutcome(name, r.status, round(seconds, 3), obj, r.message[:200] if r.plan is None else "")


def _labelled(name, best: Plan, found: SolveResult | None, results, floor, stats: RunStats, options, seconds, every):
    """`best` as the run's result: its gap against the larger of the lower bound on every plan (`floor`: value, what
    sets it) and, where the stage MILP's bound holds for every plan (`every`: one device, graph order the only
    order), that bound (capped at the plan's objective). Not optimal: "feasible" where an exact model finished, else
    "time_limit" or "heuristic"."""
    value = objective(best, options.alpha_energy)
    bound, source = floor
    # the stage MILP's bound is on its own objective, the makespan of its every plan only on a problem of one device
    # (no copies, nothing in parallel); and it holds for plans that first compute the ops in graph order, every plan
    # only where that is the graph's one order (elsewhere the MILP's record already carries the floor as its bound)
    milp = [r.record.bound for r in results if r.method == "milp" and r.record.bound is not None and every]
    if milp and max(milp) > bound:
        bound, source = min(max(milp), value), "the stage MILP's bound (graph order the only order)"
    gap = _relative_gap(value, bound)
    status = "optimal" if gap <= options.mip_gap or _proven(found, every) else "time_limit" if results else "heuristic"
    if status == "time_limit" and _exact(found) and found.status in ("optimal", "feasible"):  # a finished model
        status = "feasible"
    stats = replace(stats, found_by=found.method if found is not None else None, found=found, bound_source=source)
    record = SolveResult(name, status, value, bound, gap, Times(solve_s=seconds), stats, repaired=best.solver.repaired)
    return Outcome(record, best)


def _method_result(method: str, results, best: Plan | None, found, stats: RunStats, seconds: float, alpha: float):
    """A single method's result: its own plan, with its own record, unless it found none or one worse than its warm
    start, which is then returned with status "heuristic" and the reason; without either, its own result (a proof,
    or NoIncumbent saying why the heuristics did not fit either)."""
    own = results[-1] if results else Outcome(SolveResult(method, "no_incumbent", message="no time to run it"))
    mine = own.record
    # a tie goes to the method: its own plan unless the warm start's objective is lower by more than rounding
    if own.plan is not None and not better(best, own.plan, alpha, tolerance=1e-9, tie_break=False):
        times = replace(mine.times, solve_s=seconds - mine.times.build_s - mine.times.extract_s)
        return Outcome(replace(mine, times=times), own.plan)
    if best is None:
        if mine.status == "infeasible":
            return own
        reasons = "; ".join(f"{o.method}: {o.message}" for o in stats.members if o.objective is None and o.message)
        err = NoIncumbent(f"{mine.message}, and no heuristic meets the budgets either ({reasons})")
        return Outcome(SolveResult(method, "no_incumbent", message=err.detail, error=err))
    if own.plan is None:
        reason = mine.message
    else:
        reason = f"the {method} plan ({mine.status}, gap {mine.gap}) has objective {mine.objective:.6g}, its warm start {found.objective:.6g}"
    stats = replace(stats, found_by=found.method, found=found, fallback_reason=reason)
    record = SolveResult(
        method, "heuristic", found.objective, None, None, Times(solve_s=seconds), stats, repaired=best.solver.repaired
    )
    return Outcome(record, best)


def _no_plan(problem, config, why, exact, seconds, cause: BudgetError | None, most_s: float = PROBE_MAX_S) -> Outcome:
    """No plan: one short BudgetError saying why, the smallest budgets known to work (looked for in a share of the
    `seconds` left, at most `most_s`), the largest known not to."""
    budgets = problem.budgets
    lows = lower_bounds(problem.graph, problem.profile, problem.devices, problem.homes)
    if exact is not None and exact.status == "infeasible":
        fails = ", ".join(f"{d} {format_bytes(b)}" for d, b in budgets.items())
    else:
        fails = ", ".join(f"{d} {format_bytes(max(lows[d].bytes - 1, 0))}" for d in budgets) + " (lower bound)"
    probe = min(PROBE_MAX_S, max(PROBE_SHARE * seconds, PROBE_MIN_S), most_s)
    works = _known_to_work(problem, probe) if probe > 0 else "none looked for (no time left)"
    msg = f"no plan within the budgets: {why}; smallest budget known to work: {works}; largest known not to: {fails}"
    device = cause.device if cause is not None else (next(iter(budgets)) if len(budgets) == 1 else None)
    err = BudgetError(msg, stage="solve", device=device, op=cause.op if cause is not None else None)
    status = "infeasible" if cause is not None or exact is not None else "no_incumbent"
    return Outcome(SolveResult(config.name, status, message=msg, error=err))


def _no_link(config: Configuration, cause: NoLinkError) -> Outcome:
    """No plan at any budget (the profile's links cannot bring a value where it is needed): the proof alone."""
    msg = f"no plan within the budgets: proven infeasible ({cause.detail}); no budget can change that"
    err = NoLinkError(msg, stage="solve", op=cause.op, value=cause.value, device=cause.device)
    return Outcome(SolveResult(config.name, "infeasible", message=msg, error=err))


def _known_to_work(problem: Problem, seconds: float) -> str:
    """The peaks of the first heuristic plan found at budgets scaled up by PROBE_FACTORS (within `seconds`)."""
    with deadline(seconds):
        for f in PROBE_FACTORS:
            bigger = problem.with_budgets({d: int(b * f) for d, b in problem.budgets.items()})
            for entry in SOLVERS.values():
                if past_deadline():  # each heuristic keeps the deadline itself: none is skipped for a guess
                    return "none found"
                if entry.kind == "heuristic":
                    r = run_member(entry, bigger, SolverOptions(), None)
                    if r.plan is not None:
                        try:
                            peaks = runnable(bigger.graph, r.plan, bigger.profile, bigger.budgets).predicted.peak_bytes
                        except BudgetError:  # wrap could not return its forward outputs
                            continue
                        found = ", ".join(f"{d} {format_bytes(peaks.get(d, 0))}" for d in problem.budgets)
                        return f"{found} ({r.method})"
    return "none found"
