"""The retention-interval model as a MILP (Pyomo, solved by HiGHS): starts chosen among a slot's events by
binaries, reads and ends by indicator binaries with big-M, memory checked at every slot start through pairwise
"j holds memory when i starts" binaries (the cumulative, linearised)."""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import pyomo.environ as pyo

from xsched.errors import BudgetError, NoIncumbent
from xsched.solve.intervals.boundary import held_highs, returned_highs
from xsched.solve.intervals.cpsat import Outcome
from xsched.solve.intervals.data import IntervalData, Late, check, never, raise_if_late
from xsched.solve.intervals.extract import Placement
from xsched.solve.milp.backends import new_highs, set_threads
from xsched.solve.options import SolverOptions, late_after, now, out_of_time

CHECK_EVERY = 500  # memory pairs built between two looks at the clock
MAX_PAIRS = 15_000  # pairwise memory rows beyond which building alone eats a minute's limit (n100: 15-20 s)


def build(data: IntervalData, late: Callable[[], bool] = never) -> pyo.ConcreteModel:
    """Variables and constraints; see the module docstring. Events are integers 0..end, big-M = end + 1. Raises
    Late when `late()` says so between constraint groups and within the memory rows (the largest group)."""
    M, end, slots = data.end + 1, data.end, data.slots
    m = pyo.ConcreteModel(name="xsched_intervals")
    n = range(len(slots))
    multi = [(k, j) for k in n for j in range(len(slots[k].starts)) if len(slots[k].starts) > 1]
    ev = [(k, v) for k in n for v in slots[k].values]
    # ---- variable groups
    m.a = pyo.Var(n, domain=pyo.Binary)  # a[k]: slot k is used
    m.x = pyo.Var(multi, domain=pyo.Binary)  # x[k, j]: slot k starts at its j-th candidate event
    m.e = pyo.Var(ev, bounds=(0, end))  # e[k, v]: last event value v of slot k stays resident (integral at optimum)
    a, x, e = m.a, m.x, m.e

    def s(k: int):  # the start event of slot k (0 when unused)
        st = slots[k].starts
        return st[0] * a[k] if len(st) == 1 else sum(t * x[k, j] for j, t in enumerate(st))

    # ---- constraint groups
    m.pick = pyo.ConstraintList()  # a used slot starts at exactly one of its events; a value ends after it starts
    for k in n:
        if len(slots[k].starts) > 1:
            m.pick.add(sum(x[k, j] for j in range(len(slots[k].starts))) == a[k])
        for v in slots[k].values:
            m.pick.add(e[k, v] >= s(k))
    m.order = pyo.ConstraintList()  # slots of one step used in order, each after the previous one's residency
    last: dict[tuple, int] = {}
    for k, sl in enumerate(slots):
        key = (sl.kind, sl.op, sl.values, sl.src, sl.device)
        if key in last:
            p = last[key]
            m.order.add(a[k] <= a[p])
            for v in sl.values:
                m.order.add(e[p, v] + 1 <= s(k) + M * (1 - a[k]))
        last[key] = k
    m.apart = pyo.ConstraintList()  # other slots of one (value, device) never overlap (o: which comes first)
    pairs = [
        (i, j, v)
        for (v, _), ks in data.of_value.items()
        for i in ks
        for j in ks
        if i < j and _kind(slots[i]) != _kind(slots[j])
    ]
    m.o = pyo.Var(range(len(pairs)), domain=pyo.Binary)
    for t, (i, j, v) in enumerate(pairs):
        both = M * (2 - a[i] - a[j])
        m.apart.add(e[i, v] + 1 <= s(j) + M * (1 - m.o[t]) + both)
        m.apart.add(e[j, v] + 1 <= s(i) + M * m.o[t] + both)
    m.frontier = pyo.ConstraintList()  # stage q computes the op at position q on some device
    for cands in data.frontier:
        lits = [a[k] if len(slots[k].starts) == 1 else x[k, 0] for k in cands]
        m.frontier.add(sum(lits) >= 1)
    reads = [(r, f) for r in data.reads for f in r.feeders]
    m.z = pyo.Var(range(len(reads)), domain=pyo.Binary)  # z: the read is served by that feeder
    m.reads = pyo.ConstraintList()  # a step reads each input from a used slot started before it, still holding it
    for t, (r, f) in enumerate(reads):
        m.reads.add(m.z[t] <= a[f])
        m.reads.add(s(f) + 1 <= s(r.slot) + M * (1 - m.z[t]))
        m.reads.add(e[f, r.value] >= s(r.slot) - M * (1 - m.z[t]))
    serial = [k for k, sl in enumerate(slots) if sl.kind == "copy" and sl.cost > 0]
    m.serial = pyo.Var(serial, domain=pyo.Binary)  # serial[k]: copy k feeds a compute of its own stage
    m.same_stage = pyo.ConstraintList()  # a copy feeding a compute comes a stage before it, or is serial
    for t, (r, f) in enumerate(reads):
        if f in m.serial and not r.strict:
            free = (M + data.width) * (1 - m.z[t] + m.serial[f])
            m.same_stage.add(s(f) + data.width + data.offset(r.slot) <= s(r.slot) + free)
        if r.strict and r.slot in m.serial:  # a copy's source held through the copy's stage, else it is serial
            free = (M + data.width) * (1 - m.z[t] + m.serial[r.slot] + _final(m, data, r.slot))
            m.same_stage.add(m.e[f, r.value] >= s(r.slot) + data.width - 1 - free)
    _serial_reads(m, data, reads)
    by_read: dict[int, list[int]] = {}
    for t, (r, _) in enumerate(reads):
        by_read.setdefault(id(r), []).append(t)
    for r in data.reads:
        m.reads.add(sum(m.z[t] for t in by_read.get(id(r), ())) >= a[r.slot])
    ends = [(k, v) for v, devs in data.ends for d in devs for k in data.of_value.get((v, d), ())]
    m.y = pyo.Var(range(len(ends)), domain=pyo.Binary)  # y: that slot holds the graph output at the end
    m.ends = pyo.ConstraintList()  # every graph output resident at the end (on its required home)
    for t, (k, v) in enumerate(ends):
        m.ends.add(m.y[t] <= a[k])
        m.ends.add(e[k, v] >= end * m.y[t])
    for v, devs in data.ends:
        y = [m.y[t] for t, (k, w) in enumerate(ends) if w == v and slots[k].device in devs]
        if not y:  # made only where no direct link reaches its home (a chain is not modelled): CP-SAT's empty clause
            where = ", ".join(data.devices[d] for d in devs)
            raise BudgetError(
                f"the interval model (this order) cannot end {data.graph.values[v].id} on {where}: it copies over "
                "direct links only",
                stage="solve",
                value=data.graph.values[v].id,
            )
        m.ends.add(sum(y) >= 1)
    held_highs(m, data, s)  # a held output: resident from the boundary to the end, never freed in between
    returned_highs(m, data, s)  # every forward output resident when backward starts (wrap returns them)
    raise_if_late(late)
    _memory(m, data, s, late)
    m.rng = pyo.ConstraintList()  # a random op runs from one RNG only
    if data.rng_groups:  # K[g, r]: random op g draws from RNG r
        m.K = pyo.Var([(gi, ri) for gi, g in enumerate(data.rng_groups) for ri in range(len(g))], domain=pyo.Binary)
        for gi, groups in enumerate(data.rng_groups):
            m.rng.add(sum(m.K[gi, ri] for ri in range(len(groups))) <= 1)
            for ri, ks in enumerate(groups):
                for k in ks:
                    m.rng.add(a[k] <= m.K[gi, ri])
    _links(m, data, x)
    m.obj = pyo.Objective(  # the timed objective (data.py): computes, links beyond them, serial copies
        expr=sum(sl.cost * a[k] for k, sl in enumerate(slots) if sl.kind == "compute")
        + sum(m.beyond[j] for j in m.beyond)
        + sum(slots[k].cost * m.serial[k] for k in serial),
        sense=pyo.minimize,
    )
    m.s_of = s
    return m


def _links(m: pyo.ConcreteModel, data: IntervalData, x) -> None:
    """beyond[j] >= the copies of each link in stage j less the stage's least compute (data.py's timed objective)."""
    slots = data.slots
    by_stage: dict[int, list[list[tuple[int, int]]]] = {}
    for (j, _, _), ks in data.link_loads().items():
        if sum(slots[k].cost for k, _ in ks) > data.floor[j]:  # else no link of it can outlast its least compute
            by_stage.setdefault(j, []).append(ks)
    m.beyond = pyo.Var(sorted(by_stage), bounds=(0, None))  # beyond[j]: stage j's busiest link past its computes
    m.link = pyo.ConstraintList()  # each link's copies of a stage run one after another beside its computes
    for j, links in by_stage.items():
        for ks in links:
            used = [m.a[k] if len(slots[k].starts) == 1 else x[k, t] for k, t in ks]
            m.link.add(m.beyond[j] >= sum(slots[k].cost * u for (k, _), u in zip(ks, used)) - data.floor[j])


def _serial_reads(m: pyo.ConcreteModel, data: IntervalData, reads: list) -> None:
    """A copy feeding a compute that starts in stage j, and not started in a stage before j, starts in j: serial.
    Implied by same_stage at integral points; in the LP it keeps half a copy feeding a reader from costing nothing
    (same_stage's big-M is slack by M / 2 there)."""
    slots = data.slots

    def lit(k: int, i: int):  # slot k starts at its i-th event
        return m.a[k] if len(slots[k].starts) == 1 else m.x[k, i]

    m.serial_read = pyo.ConstraintList()  # a feeder copy not in an earlier stage than its reader's is serial
    for t, (r, f) in enumerate(reads):
        if f not in m.serial or r.strict:
            continue
        stages = [data.stage(e) for e in slots[f].starts]
        for i, e in enumerate(slots[r.slot].starts):
            j = data.stage(e)
            if j in stages:
                early = sum(lit(f, q) for q, sq in enumerate(stages) if sq < j)
                m.serial_read.add(m.serial[f] >= m.z[t] + lit(r.slot, i) - 1 - early)


def _final(m: pyo.ConcreteModel, data: IntervalData, k: int):
    """1 when copy slot k is one of the final copies (no compute follows: its source needs no holding)."""
    starts = data.slots[k].starts
    if starts[-1] != data.end:
        return 0
    return m.a[k] if len(starts) == 1 else m.x[k, len(starts) - 1]


def _kind(sl) -> tuple:
    return (sl.kind, sl.op, sl.src)


def _memory(m: pyo.ConcreteModel, data: IntervalData, s, late: Callable[[], bool]) -> None:
    """At the start of each slot i on a capped device: its own values and workspace, plus every value w of slot j
    with s_j <= s_i <= e_jw (o >= a_j + p + q - 2, p: j started by then, q: w still held), within the capacity."""
    slots, M = data.slots, data.end + 1
    m.mem = pyo.ConstraintList()  # memory at each slot start within the device's capacity
    trip = []
    for d, cap in enumerate(data.capacity):
        if cap is None:
            continue
        on = [k for k, sl in enumerate(slots) if sl.device == d]
        for i in on:
            for j in on:
                if j != i and slots[j].starts[0] <= slots[i].starts[-1] and any(data.mem[w] for w in slots[j].values):
                    trip.append((i, j))
    if len(trip) > MAX_PAIRS:
        raise NoIncumbent(
            f"the linearised interval model needs {len(trip):,} pairwise memory rows (more than "
            f"{MAX_PAIRS:,}): too big for HiGHS in useful time; the CP-SAT backend takes it"
        )
    # a used j whose last candidate event precedes i's first always starts before i: p is 1 there, no row
    before = {t for t, (i, j) in enumerate(trip) if slots[j].starts[-1] < slots[i].starts[0]}
    m.p = pyo.Var([t for t in range(len(trip)) if t not in before], domain=pyo.Binary)  # p[t]: j starts by i
    m.h = pyo.Var([(t, w) for t, (_, j) in enumerate(trip) for w in slots[j].values], domain=pyo.Binary)
    # h[t, w]: value w of slot j is still held when slot i starts (o: both, memory counted)
    m.o_mem = pyo.Var([(t, w) for t, (_, j) in enumerate(trip) for w in slots[j].values], bounds=(0, 1))
    # o_mem[t, w]: value w of slot j counts in the memory at slot i's start
    held: dict[int, list] = {}
    for t, (i, j) in enumerate(trip):
        check(late, t, CHECK_EVERY)
        if t not in before:
            m.mem.add(s(j) >= s(i) + 1 - M * m.p[t] - M * (1 - m.a[j]))
        p = 1 if t in before else m.p[t]
        for w in slots[j].values:
            m.mem.add(m.e[j, w] <= s(i) - 1 + M * m.h[t, w])
            m.mem.add(m.o_mem[t, w] >= m.a[j] + p + m.h[t, w] - 2)
            held.setdefault(i, []).append(data.mem[w] * m.o_mem[t, w])
    _fed(m, data, trip)
    _too_big(m, data)
    # an unused slot i starts at 0: its p can be 0 (and its reads unserved), so only the o of its `before` pairs
    # are forced (h is 1 there), by every value of those j: the row's slack for an unused slot need cover just
    # that (was every byte of the device: in the LP, a slot used 0.99 had its row slack by a tenth of the budget)
    forced: dict[int, int] = {}
    for t in before:
        i, j = trip[t]
        forced[i] = forced.get(i, 0) + sum(data.mem[w] for w in slots[j].values)
    for i, sl in enumerate(slots):
        cap = data.capacity[sl.device]
        if cap is None:
            continue
        own = sum(data.mem[w] for w in sl.values) + data.workspace.get(i, 0)
        big = max(0, forced.get(i, 0) - max(cap, 0))  # relaxes the row for an unused slot
        m.mem.add(sum(held.get(i, [])) + own * m.a[i] <= max(cap, 0) + big * (1 - m.a[i]))


def _too_big(m: pyo.ConcreteModel, data: IntervalData) -> None:
    """A compute slot needs its inputs (but those homed there, outside the capacity), its outputs and workspace at its
    start: where they alone exceed the capacity it is never used. Implied by the memory rows at integral points; in
    the LP a slot used 0.9 passes them (diamond_train's bd on a 60% gpu: 66 B against 60 B, as 0.9 x 66)."""
    m.too_big = pyo.ConstraintList()  # a compute that cannot fit its own device is not used
    vix = {v.id: k for k, v in enumerate(data.graph.values)}
    homed = {(vix[v], data.devices.index(d)) for v, d in data.homes.items() if v in vix}
    for k, sl in enumerate(data.slots):
        cap = data.capacity[sl.device]
        if sl.kind != "compute" or cap is None:
            continue
        ins = {vix[v] for v in data.graph.ops[sl.op].inputs if (vix[v], sl.device) not in homed}
        need = sum(data.mem[v] for v in ins) + sum(data.mem[w] for w in sl.values) + data.workspace.get(k, 0)
        if need > cap:
            m.too_big.add(m.a[k] == 0)


def _fed(m: pyo.ConcreteModel, data: IntervalData, trip: list[tuple[int, int]]) -> None:
    """A read served by feeder f (z) has f holding the value at its reader's start, so it counts in the memory
    there: o_mem >= z. Implied by the rows above at integral points; in the LP it keeps the big-M rows from
    hiding the inputs (chain3_train's two-device model: proven at the root node, was ~1,000 nodes and 14 s)."""
    pair = {ij: t for t, ij in enumerate(trip)}
    served = [(r.slot, f, r.value) for r in data.reads for f in r.feeders]  # in m.z's order
    m.fed = pyo.ConstraintList()  # a served read's value counts in its reader's memory row
    for u, (slot, f, v) in enumerate(served):
        if (slot, f) in pair:
            m.fed.add(m.o_mem[pair[slot, f], v] >= m.z[u])


def solve_highs_intervals(
    data: IntervalData, time_limit_s: float, hint: Placement | None, options: SolverOptions
) -> Outcome:
    """Build and solve with HiGHS (highspy, one sparse hand-off), from `hint` as a MIP start when given."""
    import highspy
    from pyomo.repn.plugins.standard_form import LinearStandardFormCompiler

    # lateness is read on the solve stage's clock (a test's fake clock included), durations on the wall clock
    t0, start = time.perf_counter(), now()
    late = late_after(start, time_limit_s)
    try:
        m = build(data, late)
    except Late:
        return Outcome("unknown", None, None, None, time.perf_counter() - t0, 0.0)
    # handing the model to HiGHS takes about as long as building it: not started when that is more than is left
    if 2 * (now() - start) > time_limit_s or out_of_time():
        return Outcome("unknown", None, None, None, time.perf_counter() - t0, 0.0)
    if hint:
        _start(m, data, hint)
    info = LinearStandardFormCompiler().write(m, mixed_form=True, set_sense=None)
    a_mat = info.A.tocsc()
    sense = np.array([r.bound_type for r in info.rows], dtype=np.int8)
    rhs, inf = np.asarray(info.rhs, dtype=float), highspy.kHighsInf
    cols = info.columns
    h = new_highs()
    h.setOptionValue("output_flag", bool(options.verbose))
    h.setOptionValue("mip_rel_gap", float(options.mip_gap))
    set_threads(h, options.solver_threads)
    h.passModel(
        len(cols),
        len(rhs),
        a_mat.nnz,
        int(highspy.MatrixFormat.kColwise),
        int(highspy.ObjSense.kMinimize),
        float(info.c_offset[0]),
        info.c.toarray()[0].astype(float),
        np.array([-inf if v.lb is None else v.lb for v in cols], dtype=float),
        np.array([inf if v.ub is None else v.ub for v in cols], dtype=float),
        np.where(sense <= 0, rhs, -inf),
        np.where(sense >= 0, rhs, inf),
        a_mat.indptr.astype(np.int32),
        a_mat.indices.astype(np.int32),
        a_mat.data.astype(float),
        np.array([int(v.is_integer()) for v in cols], dtype=np.int32),
    )
    if hint:
        sol = highspy.HighsSolution()
        sol.col_value, sol.value_valid = [float(v.value or 0.0) for v in cols], True
        h.setSolution(sol)
    build_s = time.perf_counter() - t0
    h.setOptionValue("time_limit", max(time_limit_s - build_s, 0.05))
    t1 = time.perf_counter()
    h.run()
    solve_s = time.perf_counter() - t1
    kind, hi = highspy.HighsModelStatus, h.getInfo()
    ms = h.getModelStatus()
    status = {kind.kOptimal: "optimal", kind.kInfeasible: "infeasible"}.get(ms, "feasible")
    if hi.primal_solution_status != 2:
        return Outcome("infeasible" if status == "infeasible" else "unknown", None, None, None, build_s, solve_s)
    col = {id(v): c for c, v in enumerate(cols)}
    val = h.getSolution().col_value
    get = lambda var: val[col[id(var)]] if id(var) in col else (var.value or 0.0)  # noqa: E731
    placed = {}
    for k, sl in enumerate(data.slots):
        if get(m.a[k]) > 0.5:
            start = (
                sl.starts[0]
                if len(sl.starts) == 1
                else next(t for j, t in enumerate(sl.starts) if get(m.x[k, j]) > 0.5)
            )
            placed[k] = (start, tuple(int(round(get(m.e[k, v]))) for v in sl.values))
    bound = hi.mip_dual_bound if np.isfinite(hi.mip_dual_bound) else None
    return Outcome(status, placed, int(round(hi.objective_function_value)), bound, build_s, solve_s)


def _start(m: pyo.ConcreteModel, data: IntervalData, hint: Placement) -> None:
    """Binaries and ends of the hinted slots; the linking binaries are left to HiGHS's repair of the start."""
    for k, sl in enumerate(data.slots):
        on = k in hint
        m.a[k].set_value(int(on))
        for j, t in enumerate(sl.starts if len(sl.starts) > 1 else ()):
            m.x[k, j].set_value(int(on and hint[k][0] == t))
        for v, ev in zip(sl.values, hint[k][1] if on else (0,) * len(sl.values)):
            m.e[k, v].set_value(ev)
