"""The CP-SAT interval model's time: stage start times, each used copy an interval on its link's time, readers of a
copy waiting for its end, and the final time the objective (the overlap model of xsched.lanes, stage by stage)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from xsched.solve.intervals.data import IntervalData, check, never, raise_if_late

# Time of a plan in stage units (events: data.py). Stage j (0..T + 1) issues its copies at T[j] and runs its computes
# one after another (every device alike, as in the sequential objective) from U[j] >= T[j]; T[j + 1] >= U[j] + the
# stage's computes; T[T + 2] = U[T + 2] is the final time, the objective. A copy k of stage sigma on link l (one copy
# lane per ordered device pair, lanes.py) is an interval [c, c + cost) on that link's time; the lane runs its copies in
# event order, so a per-link time G_l[j] >= T[j] splits it: stage j's copies run within [G_l[j], G_l[j + 1]).
# The copy is over by a time point rho of the sequence Z = T[0], U[0], T[1], U[1], ... (Z[2j] = T[j], Z[2j + 1] =
# U[j]): c + cost <= Z[rho], rho = 2 jd + bd > 2 sigma. A compute of stage r reading it needs rho <= 2r + 1 (before the
# stage's computes), a copy of stage r rho <= 2r (before the stage's copies). Its source stays resident (the extracted
# plan frees it after the residency's last event, and what follows waits for that free, lanes.py) through stage jd's
# copy event when bd (what follows: stage jd's computes, from U[jd]), else through stage jd - 1's last compute (what
# follows: stage jd's copies, from T[jd]); done at the final time, held to the end (the final copies are held there by
# their read). The variable-index bounds (c >= G_l[sigma], c + cost <= G_l[sigma + 1], c + cost <= Z[rho]) are boxes
# on a plane of stage x time that may not overlap a staircase of fixed-stage boxes (NoOverlap2D): O(copies + stages)
# where an element constraint per copy took a literal per candidate stage (330,000 on GPT-2 with a host store).


@dataclass
class LinkTime:
    """The time variables of one CP-SAT model and the read constraints that use them."""

    data: IntervalData
    stage_of: list  # slot -> its stage number (an affine expression of its stage index)
    done: dict = field(default_factory=dict)  # copy slot -> rho: it is over by Z[rho]
    parts: dict = field(default_factory=dict)  # copy slot -> (jd, bd, at_end: rho is 2n, None where it cannot be)
    store_hold: dict = field(default_factory=dict)  # copy slot from a device that computes nothing -> h (below)
    final: object = None  # the final time (objective)
    horizon: int = 0
    times: dict = field(default_factory=dict)  # name -> its variables: T, U, P (lists), c (by copy), G (by link)

    def read(self, m, lit, feeder: int, reader: int) -> None:
        """`reader` reads `feeder`'s value when `lit`: after the copy `feeder` is over (no condition on a compute)."""
        if feeder not in self.done:
            return
        before = 2 * self.stage_of[reader] + (self.data.slots[reader].kind == "compute")
        m.Add(self.done[feeder] <= before).OnlyEnforceIf(lit)

    def hold(self, m, lit, source_end, copy: int) -> None:
        """The source (its residency's end `source_end`) of copy slot `copy` held until what follows its free can
        only start after the copy is over (the comment above)."""
        if copy not in self.done:  # a copy that takes no time: held to its event (the read's own rule)
            return
        d, w = self.data, self.data.width
        if copy in self.store_hold:  # its free after stage h - 1's copy event, before stage h's copies into it
            m.Add(source_end >= 1 + w * (self.store_hold[copy] - 1)).OnlyEnforceIf(lit)
            return
        jd, bd, at_end = self.parts[copy]
        m.Add(source_end >= 1 + w * jd).OnlyEnforceIf([lit, bd])
        rest = [lit, bd.Not()] + ([at_end.Not()] if at_end is not None else [])
        m.Add(source_end >= (w + 1) * jd - w + 1).OnlyEnforceIf(rest)
        if at_end is not None:
            m.Add(source_end >= d.end).OnlyEnforceIf([lit, at_end])


def build_link_time(m, data: IntervalData, a: list, stage: list, late: Callable[[], bool] = never) -> LinkTime:
    """The time variables and constraints of `data`'s model `m` (slots used: a; their stage indices: stage).
    Raises Late when `late()` says so (looked at within the loops over copies and links)."""
    n = len(data.order) + 2  # stages 0..T + 1; index n is the end
    first = [data.stage(sl.starts[0]) for sl in data.slots]
    stage_of = [first[k] + stage[k] for k in range(len(data.slots))]
    computes = [k for k, sl in enumerate(data.slots) if sl.kind == "compute"]
    copies = [k for k, sl in enumerate(data.slots) if sl.kind == "copy" and sl.cost > 0]
    horizon = sum(sl.cost for sl in data.slots) + 1  # every used step one after another fits
    lt = LinkTime(data, stage_of, horizon=horizon)
    work = sum(data.slots[k].cost * a[k] for k in computes)  # every compute, one after another
    if not copies:  # no copy takes time: the final time is the computes' (the sequential objective, linear)
        lt.final = work
        return lt
    # ---- variable groups
    T = [m.NewIntVar(0, horizon, f"T{j}") for j in range(n + 1)]  # T[j]: stage j issues its copies
    U = [m.NewIntVar(0, horizon, f"U{j}") for j in range(n + 1)]  # U[j]: stage j's computes start
    cap = sum(data.slots[k].cost for k in computes) + 1  # more than every compute slot used
    P = [m.NewIntVar(0, cap, f"P{j}") for j in range(n)]  # P[j]: stage j's computes, one after another
    for x, k in enumerate(copies):  # rho[k] = 2 jd[k] + bd[k]: copy k is over by Z[rho] (2n: the final time)
        check(late, x)
        final = data.slots[k].starts[-1] == data.end  # it may be a final copy, or one over at the final time
        jd, bd = m.NewIntVar(first[k], n, f"jd{k}"), m.NewBoolVar(f"bd{k}")
        rho = lt.done[k] = m.NewIntVar(2 * first[k] + 1, 2 * n if final else 2 * n - 1, f"rho{k}")
        m.Add(rho == 2 * jd + bd)
        m.Add(rho > 2 * stage_of[k])
        at_end = None
        if final:
            at_end = m.NewBoolVar(f"atend{k}")
            m.Add(rho == 2 * n).OnlyEnforceIf(at_end)
            m.Add(rho < 2 * n).OnlyEnforceIf(at_end.Not())
        lt.parts[k] = (jd, bd, at_end)
    c = {k: m.NewIntVar(0, horizon, f"c{k}") for k in copies}  # c[k]: copy k starts on its link
    computing = {sl.device for sl in data.slots if sl.kind == "compute"}
    for k in copies:  # h[k]: a copy out of a store is over before stage h's copies into the store start (G)
        if data.slots[k].src not in computing:
            h = lt.store_hold[k] = m.NewIntVar(first[k] + 1, n, f"h{k}")
            m.Add(h > stage_of[k])
    links = sorted({(data.slots[k].src, data.slots[k].device) for k in copies})
    G = {ln: [m.NewIntVar(0, horizon, f"G{ln[0]}_{ln[1]}_{j}") for j in range(n + 1)] for ln in links}
    # G[l][j]: link l's copies of stages < j are over and those of stage >= j start (its lane runs in event order)
    # ---- constraint groups
    m.Add(T[0] == 0)
    for j in range(n):  # a stage's computes after its copies are issued, the next stage after them
        m.Add(U[j] >= T[j])
        m.Add(T[j + 1] >= U[j] + P[j])
    m.Add(U[n] == T[n])
    m.Add(T[n] >= work)  # redundant (the stages add up to it): the linear relaxation's bound, as without copies
    load = [(m.NewOptionalFixedSizeIntervalVar(stage_of[k], 1, a[k], f"at{k}"), data.slots[k].cost) for k in computes]
    for j in range(n):  # P[j] >= the computes of stage j: a cumulative over stage numbers, filler cap - P[j]
        load.append((m.NewFixedSizeIntervalVar(j, 1, f"pfill{j}"), cap - P[j]))
    m.AddCumulative([x for x, _ in load], [w for _, w in load], cap)
    cy = {k: m.NewOptionalFixedSizeIntervalVar(c[k], data.slots[k].cost, a[k], f"cy{k}") for k in copies}
    for ln in links:  # each link: its lane's stage split and its copies' boxes on the stage x time plane
        raise_if_late(late)
        g = G[ln]
        for j in range(n):
            m.Add(g[j] >= T[j])
            m.Add(g[j + 1] >= g[j])
        xs, ys, xe, ye = [], [], [], []
        for j in range(n):  # staircase: before G[j] and from G[j + 1] on, in stage j
            check(late, j)
            x = m.NewFixedSizeIntervalVar(j, 1, f"sx{ln}_{j}")
            xs += [x, x]
            ys.append(m.NewIntervalVar(-1, g[j] + 1, g[j], f"sb{ln}_{j}"))
            ys.append(m.NewIntervalVar(g[j + 1], horizon + 1 - g[j + 1], horizon + 1, f"sa{ln}_{j}"))
        for x in range(2 * n + 1):  # and from Z[x] on, at x (a copy over by Z[x] ends before)
            check(late, x)
            z = T[x // 2] if x % 2 == 0 else U[x // 2]
            xe.append(m.NewFixedSizeIntervalVar(x, 1, f"zx{ln}_{x}"))
            ye.append(m.NewIntervalVar(z, horizon + 1 - z, horizon + 1, f"za{ln}_{x}"))
        for k in copies:
            if (data.slots[k].src, data.slots[k].device) != ln:
                continue
            y = cy[k]
            xs.append(m.NewOptionalFixedSizeIntervalVar(stage_of[k], 1, a[k], f"cx{k}"))
            ys.append(y)
            xe.append(m.NewOptionalFixedSizeIntervalVar(lt.done[k], 1, a[k], f"dx{k}"))
            ye.append(y)
        m.AddNoOverlap2D(xs, ys)
        m.AddNoOverlap2D(xe, ye)
    for ln in links:  # a store's frees wait for its copies out and the copies into it for its frees (lanes.py)
        held = [k for k in copies if (data.slots[k].src, data.slots[k].device) == ln and k in lt.store_hold]
        for into in (li for li in links if li[1] == ln[0] and held):
            xh = [m.NewFixedSizeIntervalVar(x, 1, f"hx{ln}{into}_{x}") for x in range(n + 1)]
            yh = [m.NewIntervalVar(z, horizon + 1 - z, horizon + 1, f"ha{ln}{into}_{x}") for x, z in enumerate(G[into])]
            xh += [m.NewOptionalFixedSizeIntervalVar(lt.store_hold[k], 1, a[k], f"hx{k}_{into}") for k in held]
            m.AddNoOverlap2D(xh, yh + [cy[k] for k in held])
    lt.final = T[n]
    lt.times = {"T": T, "U": U, "P": P, "c": c, "G": G}
    return lt


def hint_times(m, lt: LinkTime, placed: Mapping[int, tuple[int, tuple[int, ...]]]) -> None:
    """Hint the time variables of placement `placed` (slot -> start, ends): each copy over as late as its readers
    and its source allow, every step as early as it can. CP-SAT found no time for a fixed GPT-2 placement in 100 s
    without it."""
    if not lt.times:  # no time variables (no copy takes time)
        return
    data, n, w = lt.data, len(lt.data.order) + 2, lt.data.width
    T, U, P, c, G = (lt.times[x] for x in "TUPcG")
    sigma = {k: data.stage(start) for k, (start, _) in placed.items()}
    ends = {(k, v): ev for k, (_, evs) in placed.items() for v, ev in zip(data.slots[k].values, evs)}
    rho = {k: 2 * n - (lt.parts[k][2] is None) for k in placed if k in lt.done}
    hold = {k: n for k in placed if k in lt.store_hold}
    for r in data.reads:  # the latest used feeder holding the value feeds the reader, as in the simulator
        if r.slot not in placed:
            continue
        at = placed[r.slot][0]
        fed = [f for f in r.feeders if f in placed and placed[f][0] < at and ends[(f, r.value)] >= at]
        f = max(fed, key=lambda x: placed[x][0], default=None)
        if f in rho:
            rho[f] = min(rho[f], 2 * sigma[r.slot] + (data.slots[r.slot].kind == "compute"))
        if f is not None and r.slot in lt.store_hold:
            hold[r.slot] = min(n, (ends[(f, r.value)] - 1) // w + 1)
        elif f is not None and r.slot in rho:  # its source held: the latest rho the residency's end allows
            e = ends[(f, r.value)]
            held = max(2 * ((e - 1) // w) + 1, 2 * ((e + w - 1) // (w + 1)), 2 * n if e >= data.end else 0)
            rho[r.slot] = min(rho[r.slot], held)
    work = [0] * n
    for k, j in sigma.items():
        if data.slots[k].kind == "compute":
            work[j] += data.slots[k].cost
    over: dict[int, list[int]] = {}  # rho -> its copies
    issued: dict[int, list[int]] = {}  # stage -> its copies
    for k in sorted(rho):
        over.setdefault(rho[k], []).append(k)
        issued.setdefault(sigma[k], []).append(k)
    held_to: dict[int, list[int]] = {}  # h -> the store's copies out held to it
    for k, x in hold.items():
        held_to.setdefault(x, []).append(k)
    t, u, lane, start = [0] * (n + 1), [0] * (n + 1), {}, {}
    g = {ln: [0] * (n + 1) for ln in G}

    def end_of(x: int) -> int:  # the latest end of the copies over by Z[x]
        return max((start[k] + data.slots[k].cost for k in over.get(x, ())), default=0)

    for j in range(n + 1):
        t[j] = max(u[j - 1] + work[j - 1] if j else 0, end_of(2 * j))
        for ln in g:  # this stage's copies of each link after its earlier ones, the stage's start and the copies
            # out of its destination store held until then
            out = [start[k] + data.slots[k].cost for k in held_to.get(j, ()) if data.slots[k].src == ln[1]]
            g[ln][j] = lane[ln] = max(t[j], lane.get(ln, 0), *out)
        for k in issued.get(j, ()):
            ln = (data.slots[k].src, data.slots[k].device)
            start[k], lane[ln] = lane[ln], lane[ln] + data.slots[k].cost
        u[j] = t[j] if j == n else max(t[j], end_of(2 * j + 1))
    for j in range(n + 1):
        m.AddHint(T[j], t[j])
        m.AddHint(U[j], u[j])
        for ln in g:
            m.AddHint(G[ln][j], g[ln][j])
    for j in range(n):
        m.AddHint(P[j], work[j])
    for k in rho:
        jd, bd, at_end = lt.parts[k]
        m.AddHint(lt.done[k], rho[k])
        m.AddHint(jd, rho[k] // 2)
        m.AddHint(bd, rho[k] % 2)
        if at_end is not None:
            m.AddHint(at_end, rho[k] == 2 * n)
        m.AddHint(c[k], start[k])
        if k in hold:
            m.AddHint(lt.store_hold[k], hold[k])
