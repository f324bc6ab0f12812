"""Recomputes dropped where the memory allows: a plan's rerun removed, its outputs kept from where they were last
made. The heuristics free and remake each value on its own, so an op with several outputs may be run again once per
output: GPT-2's attention dropout is rerun in backward for its output (read by a matmul's backward) and again, a few
steps later, for its mask (read by the dropout's backward), the mask freed in between though 96 MiB beside the
384 MiB the second rerun makes. Each rerun, dearest first, is dropped where the plan then still fits its budgets
and is faster (the simulator replays it): 123.2 -> 121.4 ms for park-search's plan of that graph at 25% of eager's
memory with the host as a store (docs/BENCHMARKS.md)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace

from xsched.contracts.graph import Graph
from xsched.contracts.plan import Compute, Copy, Free, Plan, Step
from xsched.contracts.profile import Profile
from xsched.errors import BudgetError, PlanError
from xsched.solve.heuristics.checkpoint import checkpoint_search
from xsched.solve.heuristics.park_recomputes import made_before, makes, read_after
from xsched.solve.heuristics.routing import finish
from xsched.solve.heuristics.timeline import op_seconds
from xsched.solve.objective import better
from xsched.solve.options import DEFAULTS, SolverOptions, keeps_limit, out_of_time
from xsched.solve.problem import Problem, runnable

METHOD = "keep-recomputes"


def without_rerun(graph: Graph, steps: Sequence[Step], k: int) -> list[Step] | None:
    """`steps` less the rerun at index `k`: each of its outputs read after it stays resident from where it was last
    made on that device (the frees between removed), and the free of one not read again goes with the rerun. None
    where an output read after `k` was not made there before, or moves in between (a copy: a park's residency)."""
    s = steps[k]
    assert isinstance(s, Compute)
    d, drop = s.device, {k}
    for w in graph.op[s.op].outputs:
        made = made_before(graph, steps, k, w, d)
        start = 0 if made is None else made + 1
        frees = [i for i in range(start, k) if _frees(steps[i], w, d)]
        if read_after(graph, steps, k, w, d):
            if made is None or any(isinstance(t, Copy) and t.value == w for t in steps[start:k]):
                return None
            drop.update(frees)
        elif frees or made is None:  # not resident when the rerun made it: its free after the rerun goes too
            after = _free_after(graph, steps, k, w, d)
            if after is not None:
                drop.add(after)
    return [t for i, t in enumerate(steps) if i not in drop]


def _frees(s: Step, v: str, d: str) -> bool:
    return isinstance(s, Free) and s.value == v and s.device == d


def _free_after(graph: Graph, steps: Sequence[Step], k: int, v: str, d: str) -> int | None:
    """The index of the free of `v` on `d` after `k`, before it is made there again."""
    for i in range(k + 1, len(steps)):
        if _frees(steps[i], v, d):
            return i
        if makes(graph, steps[i], v, d):
            return None
    return None


def keep_recomputes(
    graph: Graph,
    plan: Plan,
    profile: Profile,
    budgets: Mapping[str, int],
    stop: Callable[[], bool] = lambda: False,
    alpha: float = 0.0,
) -> Plan | None:
    """`plan` with every rerun dropped whose outputs can be kept instead, where the plan then fits the budgets and
    is better (`objective.better`), dearest rerun first; None when none can. `stop` ends the search between two
    tries (each replays the plan)."""
    cost: dict[str, dict[str, float]] = {}

    def seconds(s: Compute) -> float:
        if s.device not in cost:
            cost[s.device] = op_seconds(graph, s.device, profile)
        return cost[s.device].get(s.op, 0.0)

    best, steps, tried = plan, list(plan.steps), set()
    while not stop():
        keys = _rerun_keys(graph, steps)
        todo = sorted((j for j in keys if keys[j] not in tried), key=lambda j: (-seconds(steps[j]), j))  # type: ignore[arg-type]
        for j in todo:
            if stop():
                return best if best is not plan else None
            tried.add(keys[j])
            edited = without_rerun(graph, steps, j)
            if edited is None:
                continue
            try:
                candidate = _checked(graph, edited, plan, profile, budgets)
            except (BudgetError, PlanError):  # over a budget, or a value no longer where a step reads it
                continue
            if better(candidate, best, alpha):
                best, steps = candidate, list(candidate.steps)
                break
        else:
            break
    return best if best is not plan else None


def _rerun_keys(graph: Graph, steps: Sequence[Step]) -> dict[int, tuple[str, str, int]]:
    """Each rerun's index -> its op, device and how many runs of the op there come before it: a name that outlives
    edits elsewhere in the plan, which shift indices."""
    runs: dict[tuple[str, str], int] = {}
    keys = {}
    for j, s in enumerate(steps):
        if isinstance(s, Compute):
            n = runs.get((s.op, s.device), 0)
            if n:
                keys[j] = (s.op, s.device, n)
            runs[(s.op, s.device)] = n + 1
    return keys


def _checked(graph: Graph, steps: list[Step], plan: Plan, profile: Profile, budgets: Mapping[str, int]) -> Plan:
    """The steps as a plan the simulator checked under the budgets (untimed first: most tries fail there), then as
    `validated` gives it (the hold and the autograd boundary rule counted)."""
    untimed = finish(graph, steps, METHOD, budgets, dict(plan.homes), profile, 0.0, lanes=False)
    return runnable(graph, replace(untimed, solver=replace(plan.solver, method=METHOD)), profile, budgets)


@keeps_limit
def keep_recomputes_search(problem: Problem, options: SolverOptions = DEFAULTS, warm: Plan | None = None) -> Plan:
    """`keep-recomputes`: the best plan so far (auto, heuristics: `SolverEntry.refines`), else the caller's warm
    start, else the checkpoint heuristic's, with the reruns it can drop by keeping their outputs, within the time
    limit; that plan itself (relabelled) where none can; BudgetError where there is none to start from."""
    start = warm if warm is not None else checkpoint_search(problem, options)
    found = keep_recomputes(
        problem.graph, start, problem.profile, problem.budgets, stop=out_of_time, alpha=options.alpha_energy
    )
    if found is None:
        return replace(start, solver=replace(start.solver, method=METHOD, status="heuristic"))
    kept = sum(isinstance(s, Compute) for s in start.steps) - sum(isinstance(s, Compute) for s in found.steps)
    why = f"{kept} reruns of {start.solver.method}'s plan dropped, their outputs kept"
    return replace(found, solver=replace(found.solver, method=METHOD, status="heuristic", message=why))
