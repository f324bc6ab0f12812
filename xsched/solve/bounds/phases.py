"""The phase bound: a linear relaxation of every plan around one cut op (the loss of a training graph), where the
ops before it, and the weights they read, must be done before it first runs, the ops after it must wait for it,
and under the budgets what is not held at that moment must be copied or computed again after it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from xsched.contracts.graph import Graph
from xsched.contracts.plan import required_homes
from xsched.contracts.profile import Profile
from xsched.solve.options import out_of_time

SAFETY = 1e-6  # relative margin below the LP's optimum: HiGHS's row tolerance is 1e-7 on rows scaled to about 1


@dataclass(frozen=True)
class Cut:
    """`op` and the ops it depends on (`before`) and that depend on it (`after`), both excluding it."""

    op: str
    before: frozenset[str]
    after: frozenset[str]


def cuts(graph: Graph, homes: Mapping[str, str]) -> list[Cut]:
    """At most four cut ops: the one with the most forward ops before it and backward ops after it (on a training
    graph, the loss); the last op up to it that reads a homed input; the reader of the largest homed input with the
    most ops after it (its copy delays them all), or without homes, of the ops ordering the most others (before or
    after them) the one with the fewest before it; the maker of the largest value that must end on a home (its
    copy follows it)."""
    if not graph.ops:
        return []
    index = graph.op_index
    below, above = _order(graph)
    cover = [below[i].bit_count() + above[i].bit_count() for i in range(len(graph.ops))]
    most = [i for i in range(len(graph.ops)) if cover[i] == max(cover, default=0)]
    fwd = sum(1 << i for i, o in enumerate(graph.ops) if o.phase == "fwd")
    bwd = sum(1 << i for i, o in enumerate(graph.ops) if o.phase != "fwd")
    split = [  # forward ops up to and including it, backward ops after it
        (((below[i] | 1 << i) & fwd).bit_count() + (above[i] & bwd).bit_count(), below[i].bit_count(), i)
        for i in range(len(graph.ops))
    ]
    loss = max(split)[2]
    picked = dict.fromkeys([loss])
    homed = [v for v in graph.inputs if v in homes and graph.consumers.get(v)]
    reads_homed = [i for i, o in enumerate(graph.ops) if any(v in homes for v in o.inputs)]
    last_read = [i for i in reads_homed if i == loss or below[loss] >> i & 1]
    picked.update(dict.fromkeys(last_read[-1:]))  # from there on, no copy of a homed input holds an op up
    if homed:
        largest = max(homed, key=lambda v: graph.value[v].nbytes)
        picked[max((index[c] for c in graph.consumers[largest]), key=lambda i: above[i].bit_count())] = None
    else:
        picked[min(most, key=lambda i: below[i].bit_count())] = None
    ends = [v for v in required_homes(graph, homes) if v in graph.producer]
    if ends:
        picked[index[graph.producer[max(ends, key=lambda v: graph.value[v].nbytes)]]] = None
    ids = [o.id for o in graph.ops]
    return [Cut(ids[i], _members(below[i], ids), _members(above[i], ids)) for i in picked]


def _order(graph: Graph) -> tuple[list[int], list[int]]:
    """Per op (by index), bitsets of the ops it depends on and of the ops depending on it."""
    index = graph.op_index
    below: list[int] = []
    for o in graph.ops:
        bits = 0
        for v in o.inputs:
            if v in graph.producer:
                p = index[graph.producer[v]]
                bits |= below[p] | (1 << p)
        below.append(bits)
    above = [0] * len(graph.ops)
    for i in range(len(graph.ops) - 1, -1, -1):
        for v in graph.ops[i].outputs:
            for c in graph.consumers.get(v, ()):
                above[i] |= above[index[c]] | (1 << index[c])
    return below, above


def _members(bits: int, ids: Sequence[str]) -> frozenset[str]:
    return frozenset(ids[i] for i in range(len(ids)) if bits >> i & 1)


class LinearProgram:
    """Variables in [0, 1] (or [0, inf)) by name, rows `sum coef x <= rhs`, minimise one variable."""

    def __init__(self) -> None:
        self.index: dict[tuple, int] = {}
        self.upper: list[float | None] = []
        self.rows: list[tuple[dict[int, float], float]] = []

    def var(self, key: tuple, upper: float | None = 1.0) -> int:
        if key not in self.index:
            self.index[key] = len(self.upper)
            self.upper.append(upper)
        return self.index[key]

    def get(self, key: tuple) -> int | None:
        return self.index.get(key)

    def row(self, terms: Sequence[tuple[int | None, float]], rhs: float) -> None:
        """sum coef x <= rhs over the terms whose variable exists (None: a fixed 0)."""
        coefs: dict[int, float] = {}
        for j, c in terms:
            if j is not None and c:
                coefs[j] = coefs.get(j, 0.0) + c
        self.rows.append((coefs, rhs))

    def minimise(self, j: int) -> float | None:
        """The least value of variable j, or None when the rows are infeasible (or the solver fails)."""
        import numpy as np
        from scipy.optimize import linprog
        from scipy.sparse import csr_matrix

        cols = [k for coefs, _ in self.rows for k in coefs]
        rows = [i for i, (coefs, _) in enumerate(self.rows) for _ in coefs]
        data = [c for coefs, _ in self.rows for c in coefs.values()]
        a = csr_matrix((data, (rows, cols)), shape=(len(self.rows), len(self.upper)))
        cost = np.zeros(len(self.upper))
        cost[j] = 1.0
        b = np.array([rhs for _, rhs in self.rows])
        res = linprog(cost, A_ub=a, b_ub=b, bounds=[(0.0, u) for u in self.upper], method="highs")
        return float(res.fun) if res.status == 0 else None


def phase_bound(
    graph: Graph, profile: Profile, devices: Sequence[str], homes: Mapping[str, str], budgets: Mapping[str, int]
) -> tuple[float, Cut] | None:
    """The least makespan of the relaxation around each of the `cuts` (seconds, a margin below), the largest, and
    its cut; None without one, with an op no device runs, or with infeasible rows (then no plan exists: the memory
    bounds say which budget).

    Why every plan satisfies the rows (X the cut op; a plan's time as the lanes model runs it):
    - Each op has a first-finishing run. S is the start of X's; F = S + its time. Every op X depends on has its
      first-finishing run over by S (by induction: X's inputs were made, or copied, by then). Every run of an op
      depending on X starts after some run of X ends, so at or after F >= S + X's least time.
    - z[o, d] (o runs on d at some time) sums to at least 1 over d; y[o, d] (its first-finishing run is on d) to 1,
      and y <= z. A device's compute lane runs one op at a time: the runs it holds fit in [0, T], the ones before
      X in [0, S], X's and those after it (and any run starting after S) in [S, T], those after X in [F, T].
    - A graph input reaches another device only by a copy, which with two devices comes over the one link from
      its home (with more, a relay could, and no link row is written). If X or an op before X reads it on d, a
      copy into d ended by S (a); any reader on d needs a copy into d starting before S (p) or after (m); a
      reader after X needs it held on d at S (r, which needs p) or a copy after S (m); X reading it holds it at S.
      One link lane runs one copy at a time: those ended by S take at most S, those started before S at most S +
      the longest copy, those started after S at most T - S, all of them at most T.
    - A value made before X and read after it on d is held on d at S (r), or copied into d after S (m), or made
      on d again after S (q[p, d]: a run of its producer starting after S, on d's lane in [S, T]). Count m only
      where neither r nor q holds: then the first time after S the value is on either device, it was held on the
      other device at S or made there after S. Held on a device at S means made there (z) or copied there by a
      copy started before S (k).
    - A parameter's gradient (or buffer update) ends on its home: made there (z) or copied there (g); made by X
      or after it, its copy starts after F.
    - At S each budgeted device holds its homed inputs, the values held there (r, each counted once), and, where X
      runs, X's outputs and the inputs of X not counted already. In the lanes model every allocation waits for the
      frees before it, so an overlapped run never holds more than the plan counts at some step: its budget.
    A relaxation of constraints every plan meets is a lower bound on every plan's makespan, and so is each cut's
    alone: past the deadline (options.out_of_time; an LP takes up to a second on GPT-2 1.56B) the cuts not yet
    solved are left out, the first is always solved."""
    best: tuple[float, Cut] | None = None
    for k, cut in enumerate(cuts(graph, homes)):
        if k and out_of_time():
            break
        model = _Model(graph, profile, list(devices), homes, budgets, cut)
        if not model.build():
            return None
        t = model.lp.minimise(model.t)
        if t is not None and (best is None or t * model.unit > best[0]):
            best = (t * model.unit, cut)
    return (best[0] * (1 - SAFETY), best[1]) if best is not None else None


class _Model:
    """The rows of `phase_bound`, each group in one method; times in units of `unit` seconds, bytes per budget."""

    def __init__(self, graph, profile, devices, homes, budgets, cut: Cut) -> None:
        self.g, self.prof, self.devices, self.cut = graph, profile, devices, cut
        self.homes, self.budgets = homes, budgets
        self.runs = {
            o.id: {d: c.time_s for d in devices if (c := profile.op_cost(o.id, d)) is not None} for o in graph.ops
        }
        self.unit = max((max(r.values()) for r in self.runs.values() if r), default=0.0) or 1.0
        self.pair = len(devices) == 2  # link rows only where a copy cannot be relayed through a third device
        self.lp = LinearProgram()
        self.t = self.lp.var(("T",), None)
        self.s = self.lp.var(("S",), None)
        self.tracked: dict[str, set[str]] = {d: set() for d in devices}  # device -> values with an r there
        # (src, dst, lane sum) -> the copies in that sum, (variable, time): `copy_var` adds, `links` writes the rows
        self.link_terms: dict[tuple[str, str, str], list[tuple[int, float]]] = {}
        self.remade = {  # the makers of values made before the cut and read after it: only they may run again
            p
            for v in graph.values
            if (p := graph.producer.get(v.id)) in cut.before
            and any(c in cut.after for c in graph.consumers.get(v.id, ()))
        }

    def build(self) -> bool:
        if any(not r for r in self.runs.values()):
            return False
        self.ops()
        self.compute_lanes()
        self.homed_inputs()
        self.saved_values()
        self.gradients()
        self.links()
        self.memory()
        return True

    def time(self, o: str, d: str) -> float:
        return self.runs[o][d] / self.unit

    def copy(self, v: str, src: str, dst: str) -> float | None:
        ct = self.prof.copy_time(v, self.g.value[v].nbytes, src, dst)
        return ct / self.unit if ct is not None else None

    def other(self, d: str) -> str:
        return self.devices[1] if d == self.devices[0] else self.devices[0]

    def ops(self) -> None:
        """Each op runs somewhere (z); the ops up to the cut have one first-finishing run (y <= z)."""
        lp = self.lp
        for o, runs in self.runs.items():
            lp.row([(lp.var(("z", o, d)), -1.0) for d in runs], -1.0)
            if o in self.cut.before or o == self.cut.op:
                lp.row([(lp.var(("y", o, d)), -1.0) for d in runs], -1.0)
                for d in runs:
                    lp.row([(lp.get(("y", o, d)), 1.0), (lp.get(("z", o, d)), -1.0)], 0.0)

    def compute_lanes(self) -> None:
        """Per device: all its runs in [0, T]; the first runs before the cut in [0, S]; from S on, the cut's run,
        every run after it and the reruns (q) in [S, T]; the runs after it in [F, T]."""
        lp, cut, x = self.lp, self.cut, self.cut.op
        x_least = min(self.runs[x].values())
        for d in self.devices:
            on = [o for o, r in self.runs.items() if d in r]
            lp.row([(lp.var(("z", o, d)), self.time(o, d)) for o in on] + [(self.t, -1.0)], 0.0)
            before = [(lp.get(("y", o, d)), self.time(o, d)) for o in on if o in cut.before]
            lp.row(before + [(self.s, -1.0)], 0.0)
            after = [(lp.get(("z", o, d)), self.time(o, d)) for o in on if o in cut.after]
            again = [(lp.var(("q", o, d)), self.time(o, d)) for o in on if o in self.remade]
            mine = [(lp.get(("y", x, d)), self.time(x, d))] if d in self.runs[x] else []
            lp.row(after + again + mine + [(self.s, 1.0), (self.t, -1.0)], 0.0)
            lp.row(after + [(self.s, 1.0), (self.t, -1.0)], -x_least / self.unit)

    def copy_var(self, key: tuple, v: str, dst: str, lanes: Sequence[str], counted: bool = True) -> int | None:
        """A copy of v into dst; with two devices it rides the link from the other device, in the link lanes'
        `lanes` sums and, if `counted` (not a copy counted by another variable already), in its "all" sum (None
        where there is no link: no copy); with more devices, no link row holds it."""
        if not self.pair:
            return self.lp.var(key)
        src = self.other(dst)
        ct = self.copy(v, src, dst)
        if ct is None:
            return None
        j = self.lp.var(key)
        for which in (*lanes, "all") if counted else lanes:
            self.link_terms.setdefault((src, dst, which), []).append((j, ct))
        return j

    def homed_inputs(self) -> None:
        """A graph input read on a device other than its home: copied in before S for a reader before the cut,
        before or after S for any reader, held at S or copied after it for a reader after the cut."""
        lp, cut = self.lp, self.cut
        for v in self.g.inputs:
            home = self.homes.get(v)
            for d in self.devices:
                readers = [o for o in self.g.consumers.get(v, ()) if d in self.runs[o]]
                if home not in self.devices or home == d or not readers:
                    continue  # (a home outside the devices: its link is not among theirs)
                ended = self.copy_var(("a", v, d), v, d, ["ended before"], counted=False)  # one of p's
                started = self.copy_var(("p", v, d), v, d, ["started before"])
                later = self.copy_var(("m", v, d), v, d, ["after"])
                held = lp.var(("r", v, d))
                self.tracked[d].add(v)
                lp.row([(ended, 1.0), (started, -1.0)], 0.0)
                lp.row([(held, 1.0), (started, -1.0)], 0.0)
                for o in readers:
                    lp.row([(lp.get(("z", o, d)), 1.0), (started, -1.0), (later, -1.0)], 0.0)
                    if o in cut.before:
                        lp.row([(lp.get(("y", o, d)), 1.0), (ended, -1.0)], 0.0)
                    if o in cut.after:
                        lp.row([(lp.get(("z", o, d)), 1.0), (held, -1.0), (later, -1.0)], 0.0)
                    if o == cut.op:  # its run starting at S reads it: held then, its copy ended by then
                        lp.row([(lp.get(("y", o, d)), 1.0), (held, -1.0)], 0.0)
                        lp.row([(lp.get(("y", o, d)), 1.0), (ended, -1.0)], 0.0)

    def saved_values(self) -> None:
        """A value made before the cut and read after it, on a device running such a reader: held there at S,
        copied in after S (from where it was held at S or made after S), or made there again after S."""
        lp, cut = self.lp, self.cut
        for u in self.g.values:
            maker = self.g.producer.get(u.id)
            if maker is None or maker not in cut.before:
                continue
            readers = [c for c in self.g.consumers.get(u.id, ()) if c in cut.after]
            places = [d for d in self.devices if any(d in self.runs[c] for c in readers)]
            if not places:
                continue
            held_on = self.devices if self.pair else places
            held = {d: lp.var(("r", u.id, d)) for d in held_on}
            for d in held_on:
                self.tracked[d].add(u.id)
                if self.pair:  # held at S: made there, or copied in by a copy started before S
                    came = self.copy_var(("k", u.id, d), u.id, d, ["started before"])
                    lp.row([(held[d], 1.0), (lp.get(("z", maker, d)), -1.0), (came, -1.0)], 0.0)
            for d in places:
                later = self.copy_var(("m", u.id, d), u.id, d, ["after"])
                again = lp.get(("q", maker, d))
                for c in readers:
                    if d in self.runs[c]:
                        lp.row([(lp.get(("z", c, d)), 1.0), (held[d], -1.0), (later, -1.0), (again, -1.0)], 0.0)
                if self.pair and later is not None:
                    e = self.other(d)
                    lp.row([(later, 1.0), (held[e], -1.0), (lp.get(("q", maker, e)), -1.0)], 0.0)
            if cut.op in self.g.consumers.get(u.id, ()):
                for d in held_on:  # X reads it where it runs: held there at S
                    lp.row([(lp.get(("y", cut.op, d)), 1.0), (held[d], -1.0)], 0.0)

    def gradients(self) -> None:
        """A value that must end on its home (a parameter's gradient) and is not made before the cut: made there,
        or copied there (after F when its maker is the cut op or runs after it)."""
        lp, cut = self.lp, self.cut
        for v, home in required_homes(self.g, self.homes).items():
            maker = self.g.producer.get(v)
            if maker is None or maker in cut.before or home not in self.devices:
                continue
            lanes = ["after", "after F"] if maker in cut.after or maker == cut.op else []
            moved = self.copy_var(("g", v), v, home, lanes)
            lp.row([(lp.get(("z", maker, home)), -1.0), (moved, -1.0)], -1.0)

    def links(self) -> None:
        """Per link lane: the copies ended by S fit in [0, S], those started before S in [0, S + the longest of
        them], those after S in [S, T], those after F in [F, T], all in [0, T]."""
        lp, x_least = self.lp, min(self.runs[self.cut.op].values()) / self.unit
        for (_, _, which), terms in self.link_terms.items():
            if which == "ended before":
                lp.row([*terms, (self.s, -1.0)], 0.0)
            elif which == "started before":
                lp.row([*terms, (self.s, -1.0)], max(ct for _, ct in terms))
            elif which == "after":
                lp.row([*terms, (self.s, 1.0), (self.t, -1.0)], 0.0)
            elif which == "after F":
                lp.row([*terms, (self.s, 1.0), (self.t, -1.0)], -x_least)
            else:
                lp.row([*terms, (self.t, -1.0)], 0.0)

    def memory(self) -> None:
        """At S a budgeted device holds its homed inputs, what is held there (r), and where the cut op runs, its
        outputs and its inputs not counted in r."""
        lp, x = self.lp, self.g.op[self.cut.op]
        size = {v.id: v.nbytes for v in self.g.values}
        for d in self.devices:
            if d not in self.budgets:
                continue
            scale = max(self.budgets[d], 1)
            homed = sum(size[v] for v in self.g.inputs if self.homes.get(v) == d)
            own = set(x.outputs) | {v for v in x.inputs if v not in self.tracked[d] and self.homes.get(v) != d}
            terms = [(lp.get(("r", v, d)), size[v] / scale) for v in sorted(self.tracked[d])]
            terms.append((lp.get(("y", x.id, d)), sum(size[v] for v in own) / scale))
            lp.row(terms, (self.budgets[d] - homed) / scale)
