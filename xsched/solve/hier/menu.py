"""Options: a block's schedule (its forward part, then its backward part) summarised for the level above — time,
the boundary values it reads and leaves on each device, the bytes it adds while running and what it keeps from
forward to backward (HiREmate's phantom) — and their translation to identical blocks."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from xsched.contracts.graph import Graph
from xsched.contracts.plan import Compute, Copy, Free, Plan, Step, rng_domain
from xsched.contracts.profile import Profile
from xsched.contracts.random_ops import random_ops
from xsched.solve.hier.park import lanes_time, parks
from xsched.solve.hier.region import Region

Res = tuple[str, str]  # (value, device): one residency


@dataclass(frozen=True)
class Part:
    """One part of an option (a block's forward or backward part). `steps` keep the sub-plan's frees (the memory
    figures were tracked through them); flattening drops them and places frees again. `reads`: boundary
    residencies it reads before making them itself, which the level above must provide; `outs`: boundary
    residencies it leaves. `run[d]`: its worst bytes on d beyond what is resident when it starts (its boundary
    outputs made so far included; for a backward part, less its phantom). `points[d]`: the worst bytes at its
    steps on d for each set of `reads` on d already read for the last time (HiREmate's correction terms: the level
    above subtracts those it frees after the part). `left[d]`: bytes of other residencies still there when the part
    ends (the phantom, for a forward part)."""

    steps: tuple[Step, ...]
    time_s: float
    energy_j: float
    reads: frozenset[Res]
    outs: frozenset[Res]
    run: Mapping[str, int]
    points: Mapping[str, tuple[tuple[int, frozenset[Res]], ...]]
    left: Mapping[str, int]
    rng: frozenset[tuple[str, str]]  # (random op, the RNG domain it draws from)


@dataclass(frozen=True)
class Option:
    """A schedule of a block: forward part, backward part (None for a block without one), the device its inputs
    from other blocks start on, and where it came from."""

    f: Part
    b: Part | None
    home: str
    label: str
    peak: Mapping[str, int]  # the simulator's peak of the block's own plan (its inputs held throughout)
    full: bool = True  # False: a recompute of part of the block (some outputs), never its first run

    @property
    def time_s(self) -> float:
        return self.f.time_s + (self.b.time_s if self.b else 0.0)

    @property
    def phantom(self) -> int:
        return sum(self.f.left.values())

    @property
    def rng(self) -> frozenset[tuple[str, str]]:
        return self.f.rng | (self.b.rng if self.b else frozenset())

    def key(self) -> tuple:
        return (self.f.steps, self.b.steps if self.b else None)


def split_index(region: Region, plan: Plan) -> int:
    """Where the backward part starts: the plan's autograd boundary (none: the whole plan is the forward part)."""
    if not region.b_ops or plan.boundary is None:
        return len(plan.steps)
    return plan.boundary


def summarize(region: Region, plan: Plan, profile: Profile, home: str, label: str) -> Option:
    """The option of a region's plan (simulated, with its predicted figures): its parts and their figures."""
    g = region.graph
    b = split_index(region, plan)
    boundary = set(region.inputs) | set(region.outputs)
    f_steps, b_steps = plan.steps[:b], plan.steps[b:]
    resident = {(v, d) for v, d in plan.homes.items()}
    for s in f_steps:
        _apply(g, s, resident)
    f_outs = frozenset((v, d) for v, d in resident if v in set(region.f_outputs))
    f = _part(g, profile, f_steps, boundary, f_outs, set())
    if not region.b_ops:
        return Option(f, None, home, label, dict(plan.predicted.peak_bytes))
    phantom = _tracked_end(g, f_steps, f_outs)
    for s in b_steps:
        _apply(g, s, resident)
    b_outs = frozenset((v, d) for v, d in resident if v in set(region.b_outputs))
    back = _part(g, profile, b_steps, boundary, b_outs, phantom)
    return Option(f, back, home, label, dict(plan.predicted.peak_bytes))


EMPTY = Part((), 0.0, 0.0, frozenset(), frozenset(), {}, {}, {}, frozenset())  # the missing part of a partial option


def partial(
    region: Region, steps: Sequence[Step], profile: Profile, home: str, label: str, backward: bool = False
) -> Option:
    """A recompute option: `steps` make some of the block's outputs only, in a later stage than its first run —
    of a block without a backward part (a forward cone), or (`backward`) of a block's backward part (a deferred
    gradient op: its forward part slot is EMPTY)."""
    g = region.graph
    outs = frozenset(
        (v, s.device) for s in steps if isinstance(s, Compute) for v in g.op[s.op].outputs if v in set(region.outputs)
    )
    boundary = set(region.inputs) | set(region.outputs)
    part = _part(g, profile, steps, boundary, outs, set())
    if backward:
        return Option(EMPTY, part, home, label, {}, full=False)
    return Option(part, None, home, label, {}, full=False)


def _apply(g: Graph, s: Step, resident: set[Res]) -> None:
    if isinstance(s, Compute):
        resident.update((v, s.device) for v in g.op[s.op].outputs)
    elif isinstance(s, Copy):
        resident.add((s.value, s.dst))
    else:
        resident.discard((s.value, s.device))


def _tracked_end(g: Graph, steps: Sequence[Step], outs: frozenset[Res]) -> set[Res]:
    tracked: set[Res] = set()
    for s in steps:
        made = _made(g, s)
        if made is None:
            tracked.discard((s.value, s.device))  # type: ignore[union-attr]
        else:
            tracked.update(r for r in made if r not in outs)
    return tracked


def _made(g: Graph, s: Step) -> list[Res] | None:
    if isinstance(s, Compute):
        return [(v, s.device) for v in g.op[s.op].outputs]
    if isinstance(s, Copy):
        return [(s.value, s.dst)]
    return None


def _part(
    g: Graph, profile: Profile, steps: Sequence[Step], boundary: set[str], outs: frozenset[Res], start: set[Res]
) -> Part:
    """Track the residencies the level above does not count (`start`: the phantom a backward part begins with;
    then those made in the part) and the boundary outputs made so far, through the steps: the bytes at each
    step, with the outputs and workspace of a running compute on top as the simulator counts them."""
    size = {v.id: v.nbytes for v in g.values}
    tracked = set(start)
    made: set[Res] = set()
    reads: dict[Res, int] = {}  # boundary residency read from outside -> index of its last read
    held: dict[str, int] = {}
    for v, d in tracked:
        held[d] = held.get(d, 0) + size[v]
    base = dict(held)
    at: list[tuple[int, str, int]] = []  # (step, device, bytes beyond base)
    randoms = random_ops(g)
    rng: set[tuple[str, str]] = set()
    time_s = energy = 0.0

    def read(i: int, v: str, d: str) -> None:
        if v in boundary and (v, d) not in made and (v, d) not in start:
            reads[(v, d)] = i

    def add(r: Res) -> None:
        if r not in made and r in outs:
            held[r[1]] = held.get(r[1], 0) + size[r[0]]  # counted from its first making on, as the level above does
        made.add(r)
        if r not in outs and r not in tracked:
            tracked.add(r)
            held[r[1]] = held.get(r[1], 0) + size[r[0]]

    for i, s in enumerate(steps):
        if isinstance(s, Compute):
            op = g.op[s.op]
            for v in op.inputs:
                read(i, v, s.device)
            cost = profile.op_cost(op.id, s.device)
            ws = max(op.workspace_bytes, cost.workspace_bytes if cost else 0)
            fresh = sum(size[v] for v in op.outputs)
            at.append((i, s.device, held.get(s.device, 0) + fresh + ws - base.get(s.device, 0)))
            for v in op.outputs:
                add((v, s.device))
            time_s += cost.time_s if cost else 0.0
            energy += cost.energy_j if cost else 0.0
            if op.id in randoms:
                rng.add((op.id, rng_domain(s.device)))
        elif isinstance(s, Copy):
            read(i, s.value, s.src)
            add((s.value, s.dst))
            at.append((i, s.dst, held.get(s.dst, 0) - base.get(s.dst, 0)))
            time_s += profile.copy_time(s.value, size[s.value], s.src, s.dst) or 0.0
            energy += profile.copy_energy(size[s.value], s.src, s.dst)
        elif isinstance(s, Free) and (s.value, s.device) in tracked:
            tracked.discard((s.value, s.device))
            held[s.device] -= size[s.value]
    run: dict[str, int] = {}
    worst: dict[tuple[str, frozenset[Res]], int] = {}
    for i, d, b in at:
        run[d] = max(run.get(d, 0), b)
        done = frozenset(r for r, last in reads.items() if last < i and r[1] == d)
        worst[(d, done)] = max(worst.get((d, done), b), b)
    points: dict[str, list[tuple[int, frozenset[Res]]]] = {}
    for (d, done), b in worst.items():  # a point is implied by one with more bytes and fewer reads done
        if not any(
            dd == d and b2 >= b and done2 <= done and (b2, done2) != (b, done) for (dd, done2), b2 in worst.items()
        ):
            points.setdefault(d, []).append((b, done))
    left = {d: b - sum(size[v] for v, dd in made if dd == d and (v, dd) in outs) for d, b in held.items()}
    if parks(steps, profile):  # its copies to and from the store move while the device computes
        time_s = lanes_time(g, profile, steps)
    return Part(
        tuple(steps),
        time_s,
        energy,
        frozenset(reads),
        outs,
        run,
        {d: tuple(sorted(p, key=lambda x: (-x[0], sorted(x[1])))) for d, p in points.items()},
        {d: b for d, b in left.items() if b > 0},
        frozenset(rng),
    )


def retime(part: Part, g: Graph, profile: Profile) -> Part:
    """The part's time and energy from another profile (a translated part: same steps, other ops); a part that
    parks, its makespan on the lanes (as `_part`)."""
    size = {v.id: v.nbytes for v in g.values}
    t = e = 0.0
    for s in part.steps:
        if isinstance(s, Compute):
            c = profile.op_cost(s.op, s.device)
            t += c.time_s if c else 0.0
            e += c.energy_j if c else 0.0
        elif isinstance(s, Copy):
            t += profile.copy_time(s.value, size[s.value], s.src, s.dst) or 0.0
            e += profile.copy_energy(size[s.value], s.src, s.dst)
    if parks(part.steps, profile):
        t = lanes_time(g, profile, part.steps)
    return replace(part, time_s=t, energy_j=e)


def translate(option: Option, ops: Mapping[str, str], values: Mapping[str, str], g: Graph, profile: Profile) -> Option:
    """The option of an identical block: op and value ids renamed, times from that block's own costs."""

    def step(s: Step) -> Step:
        if isinstance(s, Compute):
            return Compute(ops[s.op], s.device)
        if isinstance(s, Copy):
            return Copy(values[s.value], s.src, s.dst)
        return Free(values[s.value], s.device)

    def part(p: Part) -> Part:
        moved = replace(
            p,
            steps=tuple(step(s) for s in p.steps),
            reads=frozenset((values[v], d) for v, d in p.reads),
            outs=frozenset((values[v], d) for v, d in p.outs),
            rng=frozenset((ops[o], r) for o, r in p.rng),
            points={
                d: tuple((b, frozenset((values[v], dd) for v, dd in done)) for b, done in pts)
                for d, pts in p.points.items()
            },
        )
        return retime(moved, g, profile)

    return Option(
        part(option.f), part(option.b) if option.b else None, option.home, option.label, option.peak, option.full
    )


def _leaving_all(options: Sequence[Option], home: str) -> list[int]:
    """The full options that leave every output (not a deferring plan, whose gradients a later recompute makes),
    on `home` if any: what a plan without recomputation can use."""

    def left(o: Option) -> int:
        return len({v for v, _ in (*o.f.outs, *(o.b.outs if o.b else ()))})

    full = [i for i, o in enumerate(options) if o.full]
    most = max((left(options[i]) for i in full), default=0)
    full = [i for i in full if left(options[i]) == most]
    return [i for i in full if options[i].home == home] or full


def fastest(options: Sequence[Option], home: str) -> int:
    mine = _leaving_all(options, home)
    return min(mine, key=lambda i: (options[i].time_s, i))


def leanest(options: Sequence[Option], home: str) -> int:
    mine = _leaving_all(options, home)

    def held(o: Option) -> int:
        runs = [*o.f.run.values(), *(o.b.run.values() if o.b else ())]
        return o.phantom + max(runs, default=0)

    return min(mine, key=lambda i: (held(options[i]), options[i].time_s, i))


def pareto(options: Sequence[Option], limit: int, stores: frozenset[str] = frozenset()) -> list[Option]:
    """The options no other beats on time, phantom and running bytes at once (per home device and outputs left),
    at most `limit` of them spread over the phantom sizes on the devices other than `stores` (what a parked value
    leaves is on a store): the largest, the smallest, then the one nearest each middle left (HiREmate's
    selection)."""
    unique: dict[tuple, Option] = {}
    for o in options:
        if o.full:
            unique.setdefault(o.key(), o)

    kept: list[Option] = []
    by_home: dict[tuple, list[Option]] = {}  # by home device and the outputs left (a deferring plan leaves others)
    for o in unique.values():
        left = sorted({v for v, _ in o.b.outs}) if o.b else []
        by_home.setdefault((o.home, tuple(left)), []).append(o)
    for home in sorted(by_home):
        group = by_home[home]
        devs = sorted({d for o in group for d in (*o.f.run, *o.f.left, *(o.b.run if o.b else {}))})

        def figures(o: Option, devs: list[str] = devs) -> tuple:
            b_run = o.b.run if o.b else {}
            return (
                o.time_s,
                *(o.f.left.get(d, 0) for d in devs),
                *(o.f.run.get(d, 0) for d in devs),
                *(b_run.get(d, 0) for d in devs),
            )

        group.sort(key=figures)
        front = [o for o in group if not any(_dominates(figures(p), figures(o)) for p in group if p is not o)]
        kept += _spread(front, limit, stores)
    return kept


def _dominates(a: tuple, b: tuple) -> bool:
    return len(a) == len(b) and all(x <= y for x, y in zip(a, b)) and a != b


def _spread(front: list[Option], limit: int, stores: frozenset[str]) -> list[Option]:
    if len(front) <= limit:
        return sorted(front, key=lambda o: o.time_s)

    def phantom(o: Option) -> int:
        return sum(b for d, b in o.f.left.items() if d not in stores)

    ranked = sorted(front, key=lambda o: (phantom(o), o.time_s))
    picked = [ranked[-1], ranked[0]]
    while len(picked) < limit:
        sizes = sorted(phantom(o) for o in picked)
        gaps = [(b - a, (a + b) / 2) for a, b in zip(sizes, sizes[1:])]
        _, mid = max(gaps)
        rest = [o for o in ranked if o not in picked]
        picked.append(min(rest, key=lambda o: (abs(phantom(o) - mid), o.time_s)))
    return sorted(picked, key=lambda o: o.time_s)
