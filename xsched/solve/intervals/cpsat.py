"""The retention-interval model in CP-SAT (OR-Tools): optional interval variables, one cumulative per device for
memory, one no-overlap per (value, device), reads as enforced literals (Moccasin's formulation, several devices)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from xsched.errors import XschedError
from xsched.solve.intervals.boundary import held_cpsat, returned_cpsat
from xsched.solve.intervals.data import IntervalData, Late, check, raise_if_late
from xsched.solve.intervals.extract import Placement
from xsched.solve.intervals.link_time import build_link_time, hint_times
from xsched.solve.options import late_after, now

KEEP = 8  # incumbents kept besides the last: the first (a completed hint) and the latest others
COMPLETE_SHARE = 0.1  # at most this share of the time to complete a hint (its unhinted literals) before the search
# of the time left after the build, the share left to the caller for replaying the solutions found (solver.py): on a
# large graph each replay takes a simulator run (0.3 s on GPT-2 1.56B), and past the limit only the first is kept
REPLAY_SHARE = 0.1


@dataclass(frozen=True)
class Outcome:
    """What a backend returns: status (optimal, feasible, infeasible, unknown), the best placement (None: none
    found), its integral objective and the solver's bound, and the build and solve times."""

    status: str
    placed: Placement | None
    objective: int | None
    bound: float | None
    build_s: float
    solve_s: float
    incumbents: tuple = ()  # (objective, placement) found before `placed`, oldest first (at most KEEP), CP-SAT


def available() -> bool:
    try:
        import ortools.sat.python.cp_model  # noqa: F401
    except ImportError:
        return False
    return True


def solve_cpsat(
    data: IntervalData,
    time_limit_s: float,
    workers: int = 0,
    seed: int = 0,
    hint: Placement | None = None,
    verbose: bool = False,
    soft: bool = False,
    timing: str = "links",
) -> Outcome:
    """Solve `data` within `time_limit_s`; workers 0: one per core; hint: a (partial) placement to start from.

    soft: the first phase for a hint over the budgets: each capacity may be exceeded at a cost above any plan's
    time, and the search stops at the first plan within the budgets (status "feasible"); a plan still over them
    comes back with status "relaxed", as a hint for the next phase.

    timing: "links" (link_time.py: copies on their links' time; the simulator's makespan on the plans tried) or
    "stages" (data.py's timed objective: an upper estimate where copies outlast their stage, but CP-SAT finds first
    plans with it from nothing where "links" found none in a minute, even on 6 ops)."""
    try:
        from ortools.sat.python import cp_model
    except ImportError as e:
        raise XschedError("the CP-SAT backend needs OR-Tools: pip install 'xsched[cpsat]'", stage="solve") from e
    # lateness is read on the solve stage's clock (a test's fake clock included), durations on the wall clock
    t0, start = time.perf_counter(), now()
    late = late_after(start, time_limit_s)
    try:
        m, (a, stage, e), excess, run_time, lt = _model(data, soft, timing, late)
        if hint:
            _hint(
                m, data, (a, stage, e), lt, hint, COMPLETE_SHARE * (time_limit_s - (now() - start)), workers, seed, late
            )
        raise_if_late(late)  # the search would start past the limit (its own, or the run's deadline)
    except Late:
        return Outcome("unknown", None, None, None, time.perf_counter() - t0, 0.0)
    build_s = time.perf_counter() - t0
    solver = cp_model.CpSolver()
    # the time left after the build, less a share for the caller's replay of the solutions (solver.py)
    solver.parameters.max_time_in_seconds = max((1 - REPLAY_SHARE) * (time_limit_s - (now() - start)), 0.05)
    solver.parameters.num_workers = workers
    solver.parameters.random_seed = seed
    solver.parameters.log_search_progress = verbose
    t1 = time.perf_counter()
    callback = _Incumbents(data, a, stage, e, excess if soft else [])
    code = solver.Solve(m, callback)
    solve_s = time.perf_counter() - t1
    status = {cp_model.OPTIMAL: "optimal", cp_model.FEASIBLE: "feasible", cp_model.INFEASIBLE: "infeasible"}.get(
        code, "unknown"
    )
    if status not in ("optimal", "feasible"):
        return Outcome(status, None, None, None, build_s, solve_s)
    if soft and any(solver.Value(x) > 0 for x in excess):
        status = "relaxed"
    placed = {
        k: (sl.starts[0] + data.width * solver.Value(stage[k]), tuple(solver.Value(e[(k, v)]) for v in sl.values))
        for k, sl in enumerate(data.slots)
        if solver.BooleanValue(a[k])
    }
    objective = int(solver.Value(run_time))
    return Outcome(
        status if not soft or status == "relaxed" else "feasible",
        placed,
        objective,
        None if soft else solver.BestObjectiveBound(),
        build_s,
        solve_s,
        tuple(x for x in callback.kept if x[1] != placed),
    )


def _model(data: IntervalData, soft: bool, timing: str, late: Callable[[], bool]):
    """The CP-SAT model of `data` (see solve_cpsat): (model, its slot variables (a, stage, e), the soft phase's
    excess bytes per device, the objective's run time, the link times or None). Raises Late when `late()` says so,
    looked at between its constraint groups and within the largest (3.9 s on GPT-2 1.56B's first order)."""
    from ortools.sat.python import cp_model

    m = cp_model.CpModel()
    end = data.end
    # ---- variable groups
    a = [m.NewBoolVar(f"a{k}") for k in range(len(data.slots))]  # a[k]: slot k is used (its step runs)
    stage = [m.NewIntVar(0, len(sl.starts) - 1, f"j{k}") for k, sl in enumerate(data.slots)]
    # stage[k]: which of its candidate events slot k starts at; s[k], the event, is affine in it
    s = [sl.starts[0] + data.width * stage[k] for k, sl in enumerate(data.slots)]
    e = {(k, v): m.NewIntVar(sl.starts[0], end, f"e{k}_{v}") for k, sl in enumerate(data.slots) for v in sl.values}
    # e[k, v]: the last event value v of slot k stays resident (its memory is held over [s, e])
    ivs: dict[tuple[int, int], object] = {}  # (slot, value) -> optional interval [s, e + 1)
    for (k, v), ev in e.items():
        m.Add(ev >= s[k])
        size = m.NewIntVar(1, end + 1, f"n{k}_{v}")
        ivs[(k, v)] = m.NewOptionalIntervalVar(s[k], size, ev + 1, a[k], f"i{k}_{v}")
        check(late, k)
    # ---- constraint groups
    for prev, nxt in _successive(data):  # symmetry: slots of one step kind used in order, earliest first
        m.AddImplication(a[nxt], a[prev])
        m.Add(s[nxt] > s[prev]).OnlyEnforceIf(a[nxt])
    for q, cands in enumerate(data.frontier):  # stage q computes the op at position q on at least one device
        check(late, q)
        start = data.slots[cands[0]].starts[0] if cands else None
        f = [m.NewBoolVar(f"f{q}_{k}") for k in cands]
        for lit, k in zip(f, cands):
            m.AddImplication(lit, a[k])
            m.Add(s[k] == start).OnlyEnforceIf(lit)
        m.AddBoolOr(f)
    if timing == "links":  # link_time.py: stage times, copies on their link's time
        lt, serial, last_stage = build_link_time(m, data, a, stage, late), {}, {}
    else:  # serial[k]: copy k feeds a compute of its own stage, which waits for it (its time counts whole)
        lt, last_stage = None, {}  # last_stage: copy slot -> literal: one of the final copies (nothing after it)
        serial = {k: m.NewBoolVar(f"serial{k}") for k, sl in enumerate(data.slots) if sl.kind == "copy" and sl.cost > 0}
    for n, r in enumerate(data.reads):  # a step reads each input from a used slot that started before it and holds it
        check(late, n)
        z = [m.NewBoolVar(f"z{r.slot}_{r.value}_{f}") for f in r.feeders]
        for lit, f in zip(z, r.feeders):
            m.AddImplication(lit, a[f])
            m.Add(s[f] < s[r.slot]).OnlyEnforceIf(lit)
            m.Add(e[(f, r.value)] >= s[r.slot]).OnlyEnforceIf(lit)
            if lt is not None:  # a copy's readers after it is over, its source held until then
                lt.read(m, lit, f, r.slot)
                if r.strict:
                    lt.hold(m, lit, e[(f, r.value)], r.slot)
            if f in serial and not r.strict:  # else the copy ran in an earlier stage, beside that stage's computes
                m.Add(s[f] + data.width + data.offset(r.slot) <= s[r.slot]).OnlyEnforceIf([lit, serial[f].Not()])
            if r.strict and r.slot in serial:  # a copy's source held through the copy's stage, else it is serial
                held = [lit, serial[r.slot].Not(), *_before_end(m, data, r.slot, stage, last_stage)]
                m.Add(e[(f, r.value)] >= s[r.slot] + data.width - 1).OnlyEnforceIf(held)
        m.AddBoolOr([*z, a[r.slot].Not()])
    beyond = _links(m, data, a, stage) if lt is None else []
    for v, devs in data.ends:  # every graph output resident at the end (on its required home when it has one)
        y = []
        for d in devs:
            for k in data.of_value.get((v, d), ()):
                lit = m.NewBoolVar(f"y{k}_{v}")
                m.AddImplication(lit, a[k])
                m.Add(e[(k, v)] == end).OnlyEnforceIf(lit)
                y.append(lit)
        m.AddBoolOr(y)
    raise_if_late(late)
    held_cpsat(m, data, a, s, e)  # a held output: resident from the boundary to the end, never freed in between
    returned_cpsat(m, data, a, s, e)  # every forward output resident when backward starts (wrap returns them)
    for (v, _), ks in data.of_value.items():  # one residency of a value on a device at a time
        if len(ks) > 1:
            m.AddNoOverlap([ivs[(k, v)] for k in ks])
    raise_if_late(late)
    excess: list = []
    for d, cap in enumerate(data.capacity):  # memory: resident intervals + the running step's workspace
        raise_if_late(late)
        if cap is None:
            continue
        items = [(ivs[(k, v)], data.mem[v]) for (k, v) in ivs if data.slots[k].device == d and data.mem[v] > 0]
        for k, w in data.workspace.items():
            if data.slots[k].device == d and w > 0:
                items.append((m.NewOptionalFixedSizeIntervalVar(s[k], 1, a[k], f"w{k}"), w))
        if items:
            total = sum(w for _, w in items)
            over = m.NewIntVar(0, total if soft else 0, f"over{d}")  # bytes over the budget (soft phase only)
            excess.append(over)
            m.AddCumulative([x for x, _ in items], [w for _, w in items], max(cap, 0) + over)
    for groups in data.rng_groups:  # a random op runs from one RNG only, so its recomputes replay its draws
        used = [m.NewBoolVar("") for _ in groups]
        for lit, ks in zip(used, groups):
            for k in ks:
                m.AddImplication(a[k], lit)
        m.AddAtMostOne(used)
    if lt is not None:
        run_time, heavy = lt.final, lt.horizon + 1  # a byte over the budget costs more than any plan's time
    else:
        run_time = (  # the timed objective (data.py): computes, links beyond them, serial copies
            sum(sl.cost * a[k] for k, sl in enumerate(data.slots) if sl.kind == "compute")
            + sum(beyond)
            + sum(data.slots[k].cost * lit for k, lit in serial.items())
        )
        # a byte over the budget costs more than any plan's time (at most every slot, and each copy again as serial)
        heavy = sum(sl.cost for sl in data.slots) + sum(sl.cost for sl in data.slots if sl.kind == "copy") + 1
    m.Minimize(run_time + heavy * sum(excess) if soft and excess else run_time)
    return m, (a, stage, e), excess, run_time, lt


def _hint(m, data: IntervalData, slot_vars, lt, hint: Placement, limit_s: float, workers: int, seed: int, late) -> None:
    """Hint placement `hint` (slot -> start, ends) and its link times, completed to every variable where a plan
    (_complete_hint, within `limit_s`). Raises Late when `late()` says so before the completion or after it."""
    a, stage, e = slot_vars

    def placement_hint() -> None:
        for k, sl in enumerate(data.slots):
            m.AddHint(a[k], k in hint)
            if k in hint:
                m.AddHint(stage[k], (hint[k][0] - sl.starts[0]) // data.width)
                for v, ev in zip(sl.values, hint[k][1]):
                    m.AddHint(e[(k, v)], ev)

    placement_hint()
    if lt is not None:  # its times: a large placement's are not found in time without them
        hint_times(m, lt, hint)
    raise_if_late(late)  # the completion is a solve of its own (0.9 s on GPT-2 1.56B, whatever its limit)
    if not _complete_hint(m, limit_s, workers, seed):
        m.ClearHints()  # not a plan (over the budgets, say): its times would only mislead the search
        placement_hint()


def _complete_hint(m, limit_s: float, workers: int, seed: int) -> bool:
    """Solve with the hinted variables fixed (fast: only the read, end and stage literals are left) and hint every
    variable from that solution: CP-SAT then starts from the hint itself, where a partial hint of a large model was
    often repaired into a worse plan. Left as it is (False) when the hint is infeasible or not completed in time."""
    from ortools.sat.python import cp_model

    solver = cp_model.CpSolver()
    solver.parameters.fix_variables_to_their_hinted_value = True
    solver.parameters.max_time_in_seconds = max(limit_s, 0.05)
    solver.parameters.num_workers = workers
    solver.parameters.random_seed = seed
    if solver.Solve(m) not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return False
    values = list(solver.ResponseProto().solution)
    m.ClearHints()
    for i, value in enumerate(values):
        m.AddHint(m.GetIntVarFromProtoIndex(i), value)
    return True


def _before_end(m, data: IntervalData, k: int, stage: list, last_stage: dict) -> list:
    """[literal: copy slot k is not one of the final copies] if it can be one (no compute follows those: their
    source needs no holding), else []."""
    starts = data.slots[k].starts
    if starts[-1] != data.end:
        return []
    if k not in last_stage:
        final = last_stage[k] = m.NewBoolVar(f"final{k}")
        m.Add(stage[k] == len(starts) - 1).OnlyEnforceIf(final)
        m.Add(stage[k] < len(starts) - 1).OnlyEnforceIf(final.Not())
    return [last_stage[k].Not()]


def _links(m, data: IntervalData, a: list, stage: list) -> list:
    """beyond[j] >= the copies of each link in stage j less the stage's least compute (data.py's timed objective),
    as one cumulative per link over stage numbers: each copy takes its stage with its time, and a fixed filler in
    stage j takes all but floor[j] + beyond[j] of the capacity. O(slots + stages), where a literal per copy and
    candidate stage came to 320,000 on GPT-2 with a host store."""
    loads = data.link_loads()
    most: dict[int, int] = {}  # stage -> its busiest link's copies, all used
    for (j, _, _), ks in loads.items():
        most[j] = max(most.get(j, 0), sum(data.slots[k].cost for k, _ in ks))
    beyond = {
        j: m.NewIntVar(0, total - data.floor[j], f"beyond{j}")
        for j, total in sorted(most.items())
        if total > data.floor[j]  # else no link of this stage can outlast its least compute
    }
    by_link: dict[tuple[int, int], set[int]] = {}
    for j, src, dst in loads:
        if j in beyond:
            by_link.setdefault((src, dst), set()).add(j)
    cap = max(data.floor) + sum(sl.cost for sl in data.slots if sl.kind == "copy")  # every filler's demand >= 0
    for (src, dst), stages in sorted(by_link.items()):
        copies = [
            k
            for k, sl in enumerate(data.slots)
            if sl.kind == "copy" and sl.cost > 0 and (sl.src, sl.device) == (src, dst)
        ]
        items = []
        for k in copies:
            first = data.stage(data.slots[k].starts[0])
            items.append((m.NewOptionalFixedSizeIntervalVar(first + stage[k], 1, a[k], f"on{k}"), data.slots[k].cost))
        for j in sorted(stages):
            items.append((m.NewFixedSizeIntervalVar(j, 1, f"fill{src}_{dst}_{j}"), cap - data.floor[j] - beyond[j]))
        m.AddCumulative([x for x, _ in items], [w for _, w in items], cap)
    return list(beyond.values())


def _Incumbents(data: IntervalData, a: list, stage: list, e: dict, excess: list):  # built lazily (ortools optional)
    """Keeps the placements of the solutions found (the first and the latest KEEP - 1), the solver's caller replays
    them: the model's time is an estimate, a later solution may replay slower. With `excess` (the soft phase):
    stops at the first solution with no byte over the budgets."""
    from ortools.sat.python import cp_model

    class Incumbents(cp_model.CpSolverSolutionCallback):
        def __init__(self) -> None:
            super().__init__()
            self.kept: list = []

        def on_solution_callback(self) -> None:
            placed = {
                k: (sl.starts[0] + data.width * self.Value(stage[k]), tuple(self.Value(e[(k, v)]) for v in sl.values))
                for k, sl in enumerate(data.slots)
                if self.BooleanValue(a[k])
            }
            found = (int(self.ObjectiveValue()), placed)
            self.kept = self.kept[:1] + self.kept[1:][-(KEEP - 2) :] + [found] if self.kept else [found]
            if excess and all(self.Value(x) == 0 for x in excess):
                self.StopSearch()

    return Incumbents()


def _successive(data: IntervalData) -> list[tuple[int, int]]:
    """(slot c, slot c+1) of the same step (compute of one op on one device, or copy of one value over one link)."""
    last: dict[tuple, int] = {}
    pairs = []
    for k, sl in enumerate(data.slots):
        key = (sl.kind, sl.op, sl.values, sl.src, sl.device)
        if key in last:
            pairs.append((last[key], k))
        last[key] = k
    return pairs
