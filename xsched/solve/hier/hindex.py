"""The H-ILP's index sets and scaled coefficients: stages over the blocks' forward parts (in order) then their
backward parts (in reverse), which block part may run with which option in which stage, which boundary value may
be resident or copied where and when."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from xsched.contracts.graph import Graph
from xsched.contracts.holds import pinned_holds
from xsched.contracts.plan import required_homes
from xsched.contracts.profile import Profile
from xsched.solve.hier.menu import EMPTY, Option, Part

BUDGET_SLACK = 1e-5  # as the stage MILP: whole bytes stay exact, the solver's tolerances cannot overshoot


@dataclass(frozen=True)
class Unit:
    """A block as the H-ILP sees it: its forward and backward ops and its options."""

    f_ops: tuple[str, ...]
    b_ops: tuple[str, ...]
    options: tuple[Option, ...]


@dataclass
class HIndex:
    """Stage-units k (stage k computes stage-unit k first; forward parts first, then backward parts in reverse)
    with options o, boundary values v (small ints) on devices d, stages t (T: only the final copies). Memory in
    units of `mu` bytes, time in `tu` seconds, energy in `eu` joules (powers of two)."""

    graph: Graph
    profile: Profile
    devices: tuple[str, ...]
    budgets: dict[str, int]
    homes: dict[str, str]
    units: list[tuple[int, str]]  # k -> (block, "f" | "b")
    parts: list[list[Part]]  # [k][o]
    twin: dict[int, int]  # backward stage-unit -> its forward stage-unit
    T: int
    mu: float
    tu: float
    eu: float
    values: list[str]
    mem: list[float]
    prod: list[int | None]  # v -> stage-unit making it (None: an input of the region)
    home: dict[int, int]  # region input v -> its home device
    const: list[float]  # [d] -> inputs homed there
    budget: list[float | None]
    outputs: list[int]
    end_dev: dict[int, int]  # output -> the device it must end on
    fwd_out: list[int]  # values resident when the first backward stage starts
    t_back: int | None  # that stage
    held: list[int]  # outputs the caller holds from that stage to the end (graph.held_outputs)
    reads: dict[tuple[int, int], list[tuple[int, int]]] = field(default_factory=dict)  # (k,o) -> [(v,d)]
    outs: dict[tuple[int, int], list[tuple[int, int]]] = field(default_factory=dict)
    time: list[list[float]] = field(default_factory=list)
    energy: list[list[float]] = field(default_factory=list)
    run: list[list[list[float]]] = field(default_factory=list)  # [k][o][d] worst while running
    points: list[list[list[list[tuple[float, list[int]]]]]] = field(default_factory=list)  # [k][o][d] -> (bytes,
    # values read for the last time already): one memory row each
    after: list[list[list[float]]] = field(default_factory=list)  # [k][o][d] change once it has run
    phantom: list[list[list[float]]] = field(default_factory=list)  # [k][o][d] for forward stage-units
    last: list[int] = field(default_factory=list)  # k -> last stage it may run in
    r_keys: list[tuple[int, int, int]] = field(default_factory=list)
    r_at: dict[int, list[int]] = field(default_factory=dict)  # t -> stage-units with R keys, in the stage's run
    # order: forward parts run again (ascending), its own stage-unit, then backward parts' partial runs (ascending:
    # a deferred gradient op goes after the stage's own part, which never reads what it makes)
    s_keys: list[tuple[int, int, int]] = field(default_factory=list)
    c_keys: list[tuple[int, int, int, int]] = field(default_factory=list)
    sp_keys: list[tuple[int, int, int]] = field(default_factory=list)
    copy_time: dict[tuple[int, int, int, int], float] = field(default_factory=dict)
    copy_energy: dict[tuple[int, int, int, int], float] = field(default_factory=dict)
    rng_class: dict[int, list[tuple[int, ...]]] = field(default_factory=dict)  # forward stage-unit -> the RNG
    # classes (distinct draws of its full options) each option's draws fit in
    full: list[list[bool]] = field(default_factory=list)  # [k][o]: False for a partial recompute option
    mine: list[list[bool]] = field(default_factory=list)  # [k][o]: the option runs this stage-unit (a partial one
    # runs one part only: a forward cone or a deferred gradient op)

    @property
    def dev_range(self) -> range:
        return range(len(self.devices))

    def again(self, k: int, o: int) -> bool:
        """Stage-unit k may run with option o in a stage after its own: any option of a forward part, a partial
        one of a backward part (a deferred gradient op)."""
        return self.mine[k][o] and (self.units[k][1] == "f" or not self.full[k][o])


def _pow2(x: float) -> float:
    return 2.0 ** (math.ceil(math.log2(x)) - 10) if x > 0 else 1.0


def index(
    graph: Graph,
    profile: Profile,
    units: Sequence[Unit],
    budgets: Mapping[str, int],
    devices: Sequence[str],
    homes: Mapping[str, str],
    fwd_out: Sequence[str],
) -> HIndex:
    """The index of the region `graph` made of `units` (in a topological order of their forward parts)."""
    devs = tuple(devices)
    dix = {d: i for i, d in enumerate(devs)}
    stage_units = [(u, "f") for u in range(len(units))] + [
        (u, "b") for u in reversed(range(len(units))) if units[u].b_ops
    ]
    T = len(stage_units)
    where = {(u, p): k for k, (u, p) in enumerate(stage_units)}
    parts = [[(o.f if p == "f" else o.b or EMPTY) for o in units[u].options] for u, p in stage_units]
    twin = {k: where[(u, "f")] for k, (u, p) in enumerate(stage_units) if p == "b"}
    twin_of = {f: b for b, f in twin.items()}
    maker = {op: where[(u, "f")] for u, un in enumerate(units) for op in un.f_ops}
    maker |= {op: where[(u, "b")] for u, un in enumerate(units) for op in un.b_ops}
    names = list(dict.fromkeys(v for ps in parts for p in ps for v, _ in sorted(p.reads | p.outs)))
    names += [v for v in graph.outputs if v not in names]
    vix = {v: i for i, v in enumerate(names)}
    size = {v.id: v.nbytes for v in graph.values}
    home = {vix[v]: dix[homes[v]] for v in names if v not in graph.producer}
    left_by = {v for k, ps in enumerate(parts) if stage_units[k][1] == "b" for p in ps for v, _ in p.outs}

    def producer(v: str) -> int | None:
        """The stage-unit making v: its op's, or that unit's backward part when the backward part leaves a value
        its forward part made (kept for a deferred gradient op)."""
        if v not in graph.producer:
            return None
        k = maker[graph.producer[v]]
        return twin_of[k] if v in left_by and k in twin_of else k

    prod = [producer(v) for v in names]
    need_end = {vix[v] for v in graph.outputs}
    end_dev = {vix[v]: dix[d] for v, d in required_homes(graph, homes).items() if v in vix}
    reads: dict[tuple[int, int], list[tuple[int, int]]] = {}
    outs: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for k, ps in enumerate(parts):
        for o, p in enumerate(ps):
            reads[(k, o)] = sorted((vix[v], dix[d]) for v, d in p.reads if home.get(vix[v]) != dix[d])
            outs[(k, o)] = sorted((vix[v], dix[d]) for v, d in p.outs)
    works = [[*(x for p in ps for x in p.run.values())] for ps in parts]
    mu = _pow2(max([*size.values(), *budgets.values(), *(max(w, default=0) for w in works), 1]))
    tu = _pow2(max(sum(max(p.time_s for p in ps) for ps in parts), 1e-12))
    eu = _pow2(max(sum(max(p.energy_j for p in ps) for ps in parts), 1e-12))
    ix = HIndex(
        graph=graph,
        profile=profile,
        devices=devs,
        budgets=dict(budgets),
        homes=dict(homes),
        units=stage_units,
        parts=parts,
        twin=twin,
        T=T,
        mu=mu,
        tu=tu,
        eu=eu,
        values=names,
        mem=[size[v] / mu for v in names],
        prod=prod,
        home=home,
        const=[sum(size[v] for v in graph.inputs if homes[v] == d) / mu for d in devs],
        budget=[(budgets[d] * (1 - BUDGET_SLACK) + 0.5) / mu if d in budgets else None for d in devs],
        outputs=sorted(need_end),
        end_dev=end_dev,
        fwd_out=[vix[v] for v in fwd_out if v in vix],
        t_back=min(twin, default=None),
        held=[vix[v] for v in pinned_holds(graph) if v in vix and vix[v] in need_end] if twin else [],
        reads=reads,
        outs=outs,
    )
    ix.full = [[o.full for o in units[u].options] for u, _ in stage_units]
    ix.mine = [[o.full or (o.b is None) == (p == "f") for o in units[u].options] for u, p in stage_units]
    _coefficients(ix)
    _keys(ix, need_end)
    _rng(ix, units)
    return ix


def _coefficients(ix: HIndex) -> None:
    nd = len(ix.devices)
    vix = {v: i for i, v in enumerate(ix.values)}
    dix = {d: i for i, d in enumerate(ix.devices)}
    for k, ps in enumerate(ix.parts):
        ix.time.append([p.time_s / ix.tu for p in ps])
        ix.energy.append([p.energy_j / ix.eu for p in ps])
        runs, afters, phantoms, points = [], [], [], []
        for o, p in enumerate(ps):
            rd = set(ix.reads[(k, o)])
            points.append(
                [
                    [
                        (b / ix.mu, sorted(vix[v] for v, dd in done if (vix[v], dix[dd]) in rd))
                        for b, done in p.points.get(d, ())
                    ]
                    for d in ix.devices
                ]
            )
            outsz = [0.0] * nd
            for v, d in ix.outs[(k, o)]:
                outsz[d] += ix.mem[v]
            own = [p.run.get(d, 0) / ix.mu for d in ix.devices]
            left = [p.left.get(d, 0) / ix.mu for d in ix.devices]
            if ix.units[k][1] == "b" and ix.full[k][o]:
                ph = [ix.parts[ix.twin[k]][o].left.get(d, 0) / ix.mu for d in ix.devices]
                after = [outsz[d] - ph[d] for d in range(nd)]
            else:
                after = [outsz[d] + left[d] for d in range(nd)]
            runs.append(own)
            afters.append(after)
            phantoms.append(left)
        ix.run.append(runs)
        ix.after.append(afters)
        ix.phantom.append(phantoms)
        ix.points.append(points)


def _keys(ix: HIndex, need_end: set[int]) -> None:
    """R only from a stage-unit's own stage to the last one that can use what it makes (a first run with a full
    option; later, a forward part with any option, a backward part with its partial ones only); S and C only
    between a value's first possible stage and the last stage that can read it (T for outputs)."""
    T, nv = ix.T, len(ix.values)
    twin_of = {f: b for b, f in ix.twin.items()}
    need = [T if v in need_end else -1 for v in range(nv)]
    ix.last = [0] * T

    for k in reversed(range(T)):
        remade = {v for o in range(len(ix.parts[k])) if ix.again(k, o) for v, _ in ix.outs[(k, o)]}
        last = max([k, twin_of.get(k, k), *(min(need[v], T - 1) for v in remade)])
        ix.last[k] = last
        for v in {v for o in range(len(ix.parts[k])) for v, _ in ix.reads[(k, o)]}:
            need[v] = max(need[v], last)
    for k in range(T):
        for t in range(k, ix.last[k] + 1):
            ix.r_at.setdefault(t, []).append(k)
            ix.r_keys += [
                (k, o, t)
                for o in range(len(ix.parts[k]))
                if (ix.again(k, o) if t > k else ix.full[k][o] and ix.mine[k][o])
            ]
        if k in twin_of:
            b = twin_of[k]
            ix.sp_keys += [(k, o, t) for o in range(len(ix.parts[k])) if ix.full[k][o] for t in range(k + 1, b + 1)]
    for t, ks in ix.r_at.items():
        ks.sort(key=lambda k, t=t: (k < t and ix.units[k][1] == "b", k))
    where: dict[int, set[int]] = {v: set() for v in range(nv)}
    for rs in (*ix.reads.values(), *ix.outs.values()):
        for v, d in rs:
            where[v].add(d)
    for v, d in ix.end_dev.items():
        where[v].add(d)
    linked = {  # device -> the stores linked to it both ways, which may hold its boundary values (parking)
        d: {s for s in range(len(ix.devices)) if s != d and _both_ways(ix, d, s)} for d in range(len(ix.devices))
    }
    for v in range(nv):
        first = 0 if ix.prod[v] is None else ix.prod[v] + 1
        if ix.prod[v] is None:
            where[v].add(ix.home[v])
        where[v].update(*(linked[d] for d in list(where[v])))
        for d in sorted(where[v]):
            if ix.home.get(v) == d:
                continue
            ix.s_keys += [(v, d, t) for t in range(first, need[v] + 1)]
        if len(ix.devices) < 2:
            continue
        for s in sorted(where[v]):
            for d in sorted(where[v]):
                if s == d or ix.home.get(v) == d or ix.profile.link(ix.devices[s], ix.devices[d]) is None:
                    continue
                for t in range(first, need[v] + 1):
                    key = (v, s, d, t)
                    ix.c_keys.append(key)
                    src, dst, name = ix.devices[s], ix.devices[d], ix.values[v]
                    nbytes = int(round(ix.mem[v] * ix.mu))
                    ix.copy_time[key] = (ix.profile.copy_time(name, nbytes, src, dst) or 0.0) / ix.tu
                    ix.copy_energy[key] = ix.profile.copy_energy(nbytes, src, dst) / ix.eu


def _both_ways(ix: HIndex, d: int, s: int) -> bool:
    """Device s is a store (declared in the profile: hier.park.with_stores) with links to and from device d."""
    dev, store = ix.devices[d], ix.devices[s]
    return store in ix.profile.stores and bool(ix.profile.link(dev, store)) and bool(ix.profile.link(store, dev))


def _rng(ix: HIndex, units: Sequence[Unit]) -> None:
    """Blocks whose options draw random numbers from different RNGs: one class per distinct set of draws of a
    full option; each option fits the classes whose draws include its own (a partial one draws a subset)."""
    for k, (u, p) in enumerate(ix.units):
        if p != "f":
            continue
        opts = units[u].options
        sigs = list(dict.fromkeys(o.rng for o in opts if o.full))
        fits = [tuple(c for c, sig in enumerate(sigs) if o.rng <= sig) for o in opts]
        if len(sigs) > 1 or any(len(f) < len(sigs) for f in fits):
            ix.rng_class[k] = fits
