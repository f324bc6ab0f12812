"""The retention-interval model's data: events of a fixed order, slots (compute or copy-in intervals) per value
and device, and the candidate slots that can feed each read. Both backends (CP-SAT, HiGHS) build from it."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from xsched.contracts.graph import Graph
from xsched.contracts.holds import pinned_holds
from xsched.contracts.plan import required_homes, rng_domain
from xsched.contracts.profile import Profile
from xsched.contracts.random_ops import random_ops
from xsched.errors import PlanError, ProfileError
from xsched.solve.autograd_boundary import forward_outputs
from xsched.solve.order.order import topological

# Events: stage j (0..T-1) of the order holds a copy event (k = -1, every copy of the stage, before its computes)
# then one compute event per order position k = 0..j (numbered with gaps: see `event`) (the op at position j is
# computed first there, earlier positions may be recomputed). Stage T holds the copies and recomputes after the last
# first compute (a plan may rebuild an output at the end: the logits, say). Stage T + 1 holds only the final copies,
# so a recompute of stage T can still be copied to its required home; the outputs are checked there (`end`). Event
# numbers start at 1; 0 is "before any step" (graph inputs on their home).
# Timed objective (the HiGHS backend; CP-SAT times copies on their links' time instead, link_time.py): the sum of the
# stages' times. A stage takes at least its computes (one after another, every device alike, as without copies) and
# at least the copies of each link (src -> dst: one copy lane each, lanes.py), which run beside its computes. Counted
# as every compute's time plus, per stage, what its busiest link takes beyond `floor` (the stage's first compute at
# its cheapest): recomputes are not taken to hide copies, so this bounds max(computes, link) from above and equals it
# when the stage recomputes nothing. A copy read by a compute of its own stage makes that compute wait: it is
# "serial" and its time counts whole. So does a copy whose source is freed before its stage ends (a free waits for
# its reads, the copy included, and the next compute there for the free; the final copies excepted: nothing follows
# them). No copy: the sum of the computes, as before.
# The objective is an upper estimate of the extracted plan's makespan (the overlapped time of lanes.py), not of its
# sequential time (the sum of every step, copies beside computes included: chain3_train on two devices, 11.5 s
# against a makespan of 11.3 s and a sequential time of 12.1 s), as the extraction runs a stage's serial copies first
# on their links (extract.py: behind another copy of its link, a serial copy's reader waits for both, and the other
# counts only beyond the stage's computes). Where it is above: computes of different devices counted one after
# another; a serial copy counted whole and also in its link's row; the floor taken on the cheapest device; a copy
# longer than its stage counted beyond it where the plan hides it. And the makespan depends on where the extraction
# places frees (a copy into a device waits for the frees before it there), which the objective does not see. So the
# model's optimum and bound are no bound on a plan's makespan: two proven optima may replay to different makespans
# (tests/test_intervals_estimate.py). With one device it is exact (the computes, one after another). The solver
# replays the solutions and keeps the simulator's best, and claims optimality and a gap only for one device.
CHECK_EVERY = 256  # ops, values or slots handled between two looks at the clock (a model's build checks its deadline)


class Late(Exception):
    """The deadline came while a model (its data, or a backend's model of it) was being built: no time is left to
    solve it."""


def never() -> bool:
    """No deadline: a build runs to its end."""
    return False


def raise_if_late(late: Callable[[], bool]) -> None:
    """Raise Late when `late()` says so (between a build's groups)."""
    if late():
        raise Late


def check(late: Callable[[], bool], count: int, every: int | None = None) -> None:
    """raise_if_late every `every` counts of a build's loop (the clock costs; default CHECK_EVERY, read here)."""
    n = CHECK_EVERY if every is None else every
    if count % n == n - 1:
        raise_if_late(late)


TIME_SCALE = 10**7  # the objective is integral: times scaled so that every op once at its slowest is about this


def event(j: int, k: int, width: int) -> int:
    """The event number of position k (-1: the copies) in stage j, stages `width` (= T + 1) events apart: the
    events a slot may start at are then an arithmetic progression (an affine function of its stage), which CP-SAT
    presolves in milliseconds where a set of scattered values took it half a minute on 500 ops."""
    return 1 + j * width + k + 1


@dataclass(frozen=True)
class Slot:
    """One optional retention interval of the outputs of `op` (compute) or of `value` (copy src -> device), c-th of
    its kind on `device`. `starts`: the events it may start at (ascending)."""

    kind: str  # "compute" or "copy"
    device: int
    c: int
    starts: tuple[int, ...]
    values: tuple[int, ...]  # values resident from the start (the op's outputs, or the copied value)
    op: int = -1  # op index (compute)
    src: int = -1  # source device (copy)
    cost: int = 0  # integral time (+ alpha * energy) of the step
    time_s: float = 0.0
    energy_j: float = 0.0


@dataclass(frozen=True)
class Read:
    """A slot needs `value` resident on `device` at its start: one of `feeders` (slot ids) must cover it; a feeder
    must start strictly before when `strict` (a copy reads what earlier events made)."""

    slot: int
    value: int
    device: int
    feeders: tuple[int, ...]
    strict: bool


@dataclass(frozen=True)
class IntervalData:
    """Everything a backend needs; slot ids index `slots`."""

    graph: Graph
    profile: Profile
    devices: tuple[str, ...]
    budgets: dict[str, int]
    homes: dict[str, str]
    order: tuple[int, ...]  # op indices in order; position q computes order[q] first in stage q
    C: int
    end: int  # the event of the final copies (stage T + 1), where the outputs are checked
    width: int  # events per stage: a slot's starts are starts[0] + width * (0, 1, ...)
    slots: tuple[Slot, ...]
    reads: tuple[Read, ...]
    frontier: tuple[tuple[int, ...], ...]  # [q] -> slot ids that may be the first compute of order[q] (stage q)
    of_value: dict[tuple[int, int], tuple[int, ...]]  # (v, d) -> slot ids making v resident on d
    capacity: tuple[int | None, ...]  # [d] -> budget minus the graph inputs fixed there (None: unlimited)
    mem: tuple[int, ...]  # v -> bytes
    workspace: dict[int, int]  # compute slot id -> workspace bytes on its device
    ends: tuple[tuple[int, tuple[int, ...]], ...]  # (output v, devices it may end on (one: required home))
    rng_groups: tuple[tuple[tuple[int, ...], ...], ...]  # per random op: its compute slots by RNG; one RNG in use
    scale: float  # seconds (+alpha joules) per objective unit
    floor: tuple[int, ...] = ()  # [j] -> stage j's least compute: its first compute on its cheapest device
    # (T, T + 1: 0, as they have no first compute)
    held: tuple[int, ...] = ()  # outputs the caller holds from the autograd boundary to the end (graph.held_outputs)
    boundary: int = 0  # the event of the plan's first backward step (its first backward compute); 0: no backward
    forward: tuple[int, ...] = ()  # the values wrap returns when backward starts (autograd_boundary.forward_outputs)

    def objective_s(self, cost: int) -> float:
        return cost * self.scale

    def stage(self, start: int) -> int:
        """The stage of an event (its copy event and its computes)."""
        return (start - 1) // self.width

    def offset(self, slot: int) -> int:
        """How many events after its stage's copy event slot `slot` starts (0: a copy; q + 1: the op at q)."""
        return (self.slots[slot].starts[0] - 1) % self.width

    def link_loads(self) -> dict[tuple[int, int, int], list[tuple[int, int]]]:
        """(stage, src, dst) -> the (copy slot, index of its start) that would move a value over that link in that
        stage: each ordered device pair is one copy lane (lanes.py), its copies of a stage run one after another."""
        loads: dict[tuple[int, int, int], list[tuple[int, int]]] = {}
        for k, sl in enumerate(self.slots):
            if sl.kind == "copy" and sl.cost > 0:
                for t, start in enumerate(sl.starts):
                    loads.setdefault((self.stage(start), sl.src, sl.device), []).append((k, t))
        return loads


def build_data(
    graph: Graph,
    profile: Profile,
    budgets: Mapping[str, int],
    devices: Sequence[str],
    homes: Mapping[str, str],
    order: Sequence[int],
    C: int,
    alpha: float = 0.0,
    least: Mapping[tuple, int] | None = None,
    late: Callable[[], bool] = never,
) -> IntervalData:
    """The slots of `order` with up to C computes of each op per device and C copies of each value per link.

    least: more slots for some steps, keyed as `step_counts` keys them: a warm start running an op more than C
    times (gap rematerialization may, several levels deep) is then a complete hint, which CP-SAT improves from.
    late: looked at within the loops over ops, values and slots; raises Late when it says so (3.4 s of a first order
    on GPT-2 1.56B's 2,225 ops)."""
    least = least or {}
    devs = tuple(devices)
    order = tuple(order)
    if not topological(graph, order):
        raise PlanError("the order is not a topological order of the graph's ops", stage="solve")
    T, nd = len(graph.ops), len(devs)
    dix = {d: k for k, d in enumerate(devs)}
    vix = {v.id: k for k, v in enumerate(graph.values)}
    for v in graph.inputs:
        if homes.get(v) not in dix:
            raise PlanError(f"graph input has home {homes.get(v)!r}, not one of {list(devs)}", stage="solve", value=v)
    costs = [[profile.op_cost(op.id, d) for d in devs] for op in graph.ops]
    for i, op in enumerate(graph.ops):
        if all(c is None for c in costs[i]):
            raise ProfileError(
                f"op cannot run on any of {list(devs)} (no cost in the profile)", stage="solve", op=op.id
            )
    pos = {i: q for q, i in enumerate(order)}
    mem = tuple(v.nbytes for v in graph.values)
    outs = [tuple(vix[v] for v in op.outputs) for op in graph.ops]
    prod = {vix[v]: graph.op_index[p] for v, p in graph.producer.items()}
    out_set = {vix[v] for v in graph.outputs}
    readers: dict[int, list[int]] = {}
    for i, op in enumerate(graph.ops):
        for v in dict.fromkeys(op.inputs):
            readers.setdefault(vix[v], []).append(i)
    slowest = sum(max(c.time_s + alpha * c.energy_j for c in row if c is not None) for row in costs) or 1.0
    scale = slowest / TIME_SCALE
    home = {vix[v]: dix[h] for v, h in homes.items() if v in vix}
    links = {(a, b): profile.link(devs[a], devs[b]) is not None for a in range(nd) for b in range(nd) if a != b}
    end = event(T + 1, -1, T + 1)

    slots: list[Slot] = []
    workspace: dict[int, int] = {}
    frontier: list[list[int]] = [[] for _ in range(T)]
    of_value: dict[tuple[int, int], list[int]] = {}
    for q, i in enumerate(order):
        check(late, q)
        op = graph.ops[i]
        reused = any(readers.get(v) or v in out_set for v in outs[i])
        for d in range(nd):
            cost = costs[i][d]
            if cost is None:
                continue
            for c in range(max(C, least.get(("compute", i, d), 0)) if reused else 1):
                first = q if c == 0 else q + 1
                # a recompute (or a first compute on a second device) may come in any later stage, T included
                starts = tuple(event(j, q, T + 1) for j in range(first, T + 1 if c or nd > 1 else q + 1))
                if not starts:
                    continue
                sid = len(slots)
                if c == 0 and starts[0] == event(q, q, T + 1):
                    frontier[q].append(sid)
                step = cost.time_s + alpha * cost.energy_j
                slots.append(
                    Slot(
                        "compute",
                        d,
                        c,
                        starts,
                        outs[i],
                        op=i,
                        cost=round(step / scale),
                        time_s=cost.time_s,
                        energy_j=cost.energy_j,
                    )
                )
                workspace[sid] = max(op.workspace_bytes, cost.workspace_bytes)
                for v in outs[i]:
                    of_value.setdefault((v, d), []).append(sid)
    # copies: into d from a linked device where v can be, at the copy event of a stage after v is first made
    can_be = {
        v: {d for d in range(nd) if of_value.get((v, d))} | ({home[v]} if v in home else set()) for v in range(len(mem))
    }
    for v in range(len(mem)):
        check(late, v)
        first = pos[prod[v]] + 1 if v in prod else 0
        useful = {d for d in range(nd) if v in out_set or any(costs[r][d] is not None for r in readers.get(v, ()))}
        # a store (no reader there) may hold v between two uses, when it has links both ways: there and back
        stores = {
            d
            for d in range(nd)
            if d not in useful and any(links.get((u, d)) for u in can_be[v]) and any(links.get((d, u)) for u in useful)
        }
        for s in sorted(can_be[v] | stores):
            for d in sorted(useful | stores):
                if d == s or not links.get((s, d)) or home.get(v) == d:
                    continue
                last = T + 1 if v in out_set else T  # a reader may be recomputed in any later stage, T included
                starts = tuple(event(j, -1, T + 1) for j in range(first, last + 1))
                if not starts:
                    continue
                for c in range(max(C, least.get(("copy", v, s, d), 0))):
                    sid = len(slots)
                    ct = profile.copy_time(graph.values[v].id, mem[v], devs[s], devs[d]) or 0.0
                    ce = profile.copy_energy(mem[v], devs[s], devs[d])
                    slots.append(
                        Slot(
                            "copy",
                            d,
                            c,
                            starts,
                            (v,),
                            src=s,
                            cost=round((ct + alpha * ce) / scale),
                            time_s=ct,
                            energy_j=ce,
                        )
                    )
                    of_value.setdefault((v, d), []).append(sid)
    reads: list[Read] = []
    for sid, sl in enumerate(slots):
        check(late, sid)
        needs = (
            [(vix[v], sl.device) for v in dict.fromkeys(graph.ops[sl.op].inputs)]
            if sl.kind == "compute"
            else [(sl.values[0], sl.src)]
        )
        for v, d in needs:
            if home.get(v) == d:
                continue  # a graph input on its home is resident throughout
            feeders = tuple(f for f in of_value.get((v, d), ()) if slots[f].starts[0] < sl.starts[-1])
            reads.append(Read(sid, v, d, feeders, sl.kind == "copy"))
    capacity = tuple(
        budgets[d] - sum(mem[v] for v, h in home.items() if h == k) if d in budgets else None
        for k, d in enumerate(devs)
    )
    need = required_homes(graph, homes)
    ends = tuple(
        (vix[v], (dix[need[v]],) if v in need else tuple(range(nd)))
        for v in dict.fromkeys(graph.outputs)
        if not (vix[v] in home and (v not in need or home[vix[v]] == dix[need[v]]))
    )
    rng_groups: list[tuple[tuple[int, ...], ...]] = []
    rngs = sorted({rng_domain(d) for d in devs})
    if len(rngs) > 1:  # a random op recomputed from another RNG could not replay its draws
        randoms = random_ops(graph)
        for i, op in enumerate(graph.ops):
            if op.id in randoms:
                rng_groups.append(
                    tuple(
                        tuple(
                            s
                            for s, sl in enumerate(slots)
                            if sl.kind == "compute" and sl.op == i and rng_domain(devs[sl.device]) == r
                        )
                        for r in rngs
                    )
                )
    tangents = {v.id for v in graph.values if v.kind == "tangent"}
    backward = [
        q for q, i in enumerate(order) if graph.ops[i].phase == "bwd" or tangents.intersection(graph.ops[i].inputs)
    ]
    boundary = event(backward[0], backward[0], T + 1) if backward else 0
    floor = tuple(min((slots[k].cost for k in frontier[q]), default=0) for q in range(T)) + (0, 0)
    return IntervalData(
        graph=graph,
        profile=profile,
        devices=devs,
        budgets=dict(budgets),
        homes=dict(homes),
        order=order,
        C=C,
        end=end,
        width=T + 1,
        slots=tuple(slots),
        reads=tuple(reads),
        frontier=tuple(tuple(f) for f in frontier),
        of_value={k: tuple(x) for k, x in of_value.items()},
        capacity=capacity,
        mem=mem,
        workspace=workspace,
        ends=ends,
        rng_groups=tuple(rng_groups),
        scale=scale,
        floor=floor,
        held=tuple(vix[v] for v in dict.fromkeys(pinned_holds(graph))) if boundary else (),
        boundary=boundary,
        forward=tuple(vix[v] for v in forward_outputs(graph)) if boundary else (),
    )
