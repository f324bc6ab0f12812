"""The MILP's sparse index sets and scaled coefficients: which (device, stage, op/value) can exist at all."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from xsched.contracts.graph import Graph
from xsched.contracts.holds import pinned_holds
from xsched.contracts.plan import Compute, autograd_boundary, rng_domain
from xsched.contracts.profile import Profile
from xsched.contracts.random_ops import random_ops
from xsched.errors import PlanError, ProfileError
from xsched.solve.options import SolverOptions

MOVABLE_KINDS = ("param", "buffer")  # graph inputs whose home the solver may pick (fix_homes=False)
# The model's budget is B * (1 - BUDGET_SLACK) + 0.5 bytes: memories are whole bytes, so a tight budget stays exact,
# while on large budgets the solver's tolerances (relative ~1e-6) cannot push a plan over the real one.
BUDGET_SLACK = 1e-5


@dataclass
class Stages:
    """Index sets over devices d, stages t (stage t computes op t first; stage T holds only the final copies),
    ops i, j, k (graph order) and values v (graph.values order), all small ints; and coefficients in units of
    `mu` bytes, `tu` seconds and `eu` joules (powers of two, so the scaling is exact)."""

    graph: Graph
    profile: Profile
    devices: tuple[str, ...]
    budgets: dict[str, int]
    homes: dict[str, str]  # fixed homes of graph inputs, by name (movable ones: the caller's choice)
    T: int
    mu: float
    tu: float
    eu: float
    prod: list[int | None]  # v -> the op producing it (None: graph input)
    users: list[tuple[int, ...]]  # v -> ops reading it, ascending
    ins: list[tuple[int, ...]]  # i -> values it reads (unique)
    outs: list[tuple[int, ...]]  # i -> values it makes
    mem: list[float]  # v -> size
    time: list[list[float]]  # [d][i] -> op time (0 where it cannot run)
    energy: list[list[float]]
    ws: list[list[float]]  # [d][i] -> workspace
    work: list[list[float]]  # [d][i] -> outputs + workspace: what a compute adds while it runs
    budget: list[float | None]  # [d] -> budget (None: unlimited)
    const_mem: list[float]  # [d] -> graph inputs fixed there (never freed)
    home: dict[int, int]  # v -> fixed home device
    free_home: tuple[int, ...]  # values whose home is a variable
    outputs: tuple[int, ...]
    end_home: dict[int, Any]  # output v -> device it must end on, or ("var", p) when p's home is a variable
    s_lo: list[int]  # v -> first stage with a residency variable (off its fixed home)
    s_hi: list[int]  # v -> last one (T when v must or may exist at the end)
    held: tuple[int, ...] = ()  # outputs the caller holds from the boundary stage to the end (graph.held_outputs)
    boundary: int | None = None  # the stage of the first backward op (None: no backward)
    r_keys: list[tuple[int, int, int]] = field(default_factory=list)
    s_keys: list[tuple[int, int, int]] = field(default_factory=list)
    c_keys: list[tuple[int, int, int, int]] = field(default_factory=list)
    h_keys: list[tuple[int, int]] = field(default_factory=list)
    rng: list[str] = field(default_factory=list)  # [d] -> the RNG device d draws from (plan.rng_domain)
    rngs: tuple[str, ...] = ()  # the distinct RNGs of the devices
    k_keys: list[tuple[int, str]] = field(default_factory=list)  # (random op, RNG), only when rngs has several
    f_keys: list[tuple[int, int, int, int]] = field(default_factory=list)
    copy_time: dict[tuple[int, int, int, int], float] = field(default_factory=dict)
    copy_energy: dict[tuple[int, int, int, int], float] = field(default_factory=dict)
    c_into: dict[tuple[int, int, int], list] = field(default_factory=dict)  # (d,t,v) -> copy keys into d
    c_at: dict[tuple[int, int], list] = field(default_factory=dict)  # (d,t) -> copy keys into d
    s_at: dict[tuple[int, int], list] = field(default_factory=dict)  # (d,t) -> values with S[d,t,v]
    r_at: dict[tuple[int, int], list] = field(default_factory=dict)  # (d,t) -> ops with R[d,t,i], ascending
    f_at: dict[tuple[int, int, int], list] = field(default_factory=dict)  # (d,t,k) -> values with F[d,t,v,k]
    f_of: dict[tuple[int, int, int], list] = field(default_factory=dict)  # (d,t,v) -> ops reading v, ascending

    @property
    def dev_range(self) -> range:
        return range(len(self.devices))

    @property
    def h_values(self) -> frozenset[int]:
        return frozenset(self.free_home)


def _pow2(x: float) -> float:
    """The power of two putting the largest coefficient x near 1024."""
    return 2.0 ** (math.ceil(math.log2(x)) - 10) if x > 0 else 1.0


def index_stages(
    graph: Graph,
    profile: Profile,
    budgets: Mapping[str, int],
    devices: Sequence[str],
    homes: Mapping[str, str],
    options: SolverOptions,
) -> Stages:
    """The sparse index sets: R only for i <= t on devices that can run op i, S only while v can exist, ..."""
    devs = tuple(devices)
    nd, T = len(devs), len(graph.ops)
    dix = {d: k for k, d in enumerate(devs)}
    vix = {v.id: k for k, v in enumerate(graph.values)}
    for v in graph.inputs:
        if homes.get(v) not in dix:
            raise PlanError(f"graph input has home {homes.get(v)!r}, not one of {list(devs)}", stage="solve", value=v)
    costs = [[profile.op_cost(op.id, d) for op in graph.ops] for d in devs]
    for i, op in enumerate(graph.ops):
        if all(c[i] is None for c in costs):
            raise ProfileError(
                f"op cannot run on any of {list(devs)} (no cost in the profile)", stage="solve", op=op.id
            )
    nv = len(graph.values)
    prod: list[int | None] = [None] * nv
    users: list[list[int]] = [[] for _ in range(nv)]
    for i, op in enumerate(graph.ops):
        for v in op.outputs:
            prod[vix[v]] = i
        for v in dict.fromkeys(op.inputs):
            users[vix[v]].append(i)
    nbytes = [v.nbytes for v in graph.values]
    work_b = [
        [
            (sum(nbytes[vix[v]] for v in op.outputs) + max(op.workspace_bytes, c[i].workspace_bytes if c[i] else 0))
            for i, op in enumerate(graph.ops)
        ]
        for c in costs
    ]
    mu = _pow2(max([*nbytes, *(max(w) for w in work_b), *budgets.values(), 1]))
    times = [[c.time_s if c else 0.0 for c in cd] for cd in costs]
    tu = _pow2(sum(max(t) for t in zip(*times)))
    energies = [[c.energy_j if c else 0.0 for c in cd] for cd in costs]
    eu = _pow2(sum(max(e) for e in zip(*energies)))
    movable = not options.fix_homes
    home = {vix[v]: dix[homes[v]] for v in graph.inputs if not (movable and graph.value[v].kind in MOVABLE_KINDS)}
    free_home = tuple(vix[v] for v in graph.inputs if vix[v] not in home)
    outputs = tuple(dict.fromkeys(vix[v] for v in graph.outputs))
    end_home: dict[int, Any] = {}
    for v in outputs:
        target = graph.values[v].grad_of or graph.values[v].updates
        if target is not None and target in homes:
            end_home[v] = home[vix[target]] if vix[target] in home else ("var", vix[target])
    runs = [[c is not None for c in cd] for cd in costs]
    link = {(a, b): profile.link(devs[a], devs[b]) is not None for a in range(nd) for b in range(nd) if a != b}
    out_set = set(outputs)

    def wanted(v: int, d: int) -> bool:  # v is read on d or may end there
        return v in out_set or any(runs[d][j] for j in users[v])

    may: list[set[int]] = []
    for v in range(nv):
        p = prod[v]
        reach = {home[v]} if v in home else set(range(nd)) if p is None else {d for d in range(nd) if runs[d][p]}
        useful = {d for d in range(nd) if wanted(v, d)}
        useful |= {d for d in range(nd) if any(link.get((d, e)) and e in useful for e in range(nd))}  # relays
        todo = list(reach)
        while todo:
            a = todo.pop()
            for b in range(nd):
                if b not in reach and link.get((a, b)) and b in useful:
                    reach.add(b)
                    todo.append(b)
        may.append(reach)
    s_lo = [0 if v in free_home else 1 if prod[v] is None else prod[v] + 1 for v in range(nv)]
    boundary = backward_stage(graph)
    held = tuple(dict.fromkeys(vix[v] for v in pinned_holds(graph))) if boundary is not None else ()
    s_hi = [T if (v in out_set or v in free_home or v in held) else (T - 1 if users[v] else -1) for v in range(nv)]
    st = Stages(
        graph=graph,
        profile=profile,
        devices=devs,
        budgets=dict(budgets),
        homes=dict(homes),
        T=T,
        mu=mu,
        tu=tu,
        eu=eu,
        prod=prod,
        users=[tuple(u) for u in users],
        ins=[tuple(dict.fromkeys(vix[v] for v in op.inputs)) for op in graph.ops],
        outs=[tuple(vix[v] for v in op.outputs) for op in graph.ops],
        mem=[b / mu for b in nbytes],
        time=[[x / tu for x in row] for row in times],
        energy=[[x / eu for x in row] for row in energies],
        ws=[[(w - sum(nbytes[vix[v]] for v in op.outputs)) / mu for w, op in zip(row, graph.ops)] for row in work_b],
        work=[[w / mu for w in row] for row in work_b],
        budget=[(budgets[d] * (1 - BUDGET_SLACK) + 0.5) / mu if d in budgets else None for d in devs],
        const_mem=[sum(nbytes[v] for v, h in home.items() if h == d) / mu for d in range(nd)],
        home=home,
        free_home=free_home,
        outputs=outputs,
        end_home=end_home,
        s_lo=s_lo,
        s_hi=s_hi,
        held=held,
        boundary=boundary,
    )
    _keys(st, runs, may, link)
    return st


def backward_stage(graph: Graph) -> int | None:
    """The first op in graph order that is a backward op or reads a tangent (`plan.autograd_boundary`'s rule): the
    stage whose computes start backward. None when there is none."""
    b = autograd_boundary(graph, [Compute(op.id, "") for op in graph.ops])
    return None if b is None or b == len(graph.ops) else b


def _keys(st: Stages, runs: list[list[bool]], may: list[set[int]], link: Mapping[tuple[int, int], bool]) -> None:
    T, nd = st.T, len(st.devices)
    out_set = set(st.outputs)
    # a recompute (i < t) is useful only if some output of op i is read later or may end the plan
    reused = [any(st.users[v] or v in out_set for v in st.outs[i]) for i in range(T)]
    for t in range(T):
        for d in range(nd):
            ops = [i for i in range(t + 1) if runs[d][i] and (i == t or reused[i])]
            st.r_at[(d, t)] = ops
            st.r_keys += [(d, t, i) for i in ops]
    st.h_keys = [(v, d) for v in st.free_home for d in range(nd)]
    st.rng = [rng_domain(d) for d in st.devices]
    st.rngs = tuple(dict.fromkeys(st.rng))
    if len(st.rngs) > 1:
        randoms = random_ops(st.graph)
        st.k_keys = [(i, r) for i, op in enumerate(st.graph.ops) if op.id in randoms for r in st.rngs]
    for v in range(len(st.mem)):
        lo, hi = st.s_lo[v], st.s_hi[v]
        for d in sorted(may[v]):
            if st.home.get(v) == d:
                continue
            for t in range(lo, hi + 1):
                st.s_keys.append((d, t, v))
                st.s_at.setdefault((d, t), []).append(v)
    s_set = set(st.s_keys)
    name = st.graph.values
    for v in range(len(st.mem)):
        last = T if v in out_set else (T - 1 if st.users[v] else -1)
        first = 0 if st.prod[v] is None else st.prod[v] + 1
        for s in sorted(may[v]):
            for d in sorted(may[v]):
                if s == d or not link.get((s, d)) or st.home.get(v) == d:
                    continue
                for t in range(first, last + 1):
                    if t == T and v not in out_set:
                        continue
                    if not (st.home.get(v) == s or (s, t, v) in s_set):
                        continue  # v cannot be resident on the source at the start of stage t
                    if t < T and not any(runs[d][j] for j in st.users[v]) and (d, t + 1, v) not in s_set:
                        continue  # nothing reads v on d in this stage and it cannot stay there
                    k = (s, d, t, v)
                    st.c_keys.append(k)
                    val = name[v]
                    src, dst = st.devices[s], st.devices[d]
                    st.copy_time[k] = (st.profile.copy_time(val.id, val.nbytes, src, dst) or 0.0) / st.tu
                    st.copy_energy[k] = st.profile.copy_energy(val.nbytes, src, dst) / st.eu
                    st.c_into.setdefault((d, t, v), []).append(k)
                    st.c_at.setdefault((d, t), []).append(k)
    for d, t, v in st.s_keys:  # the `once` constraints also cover residency without copies in
        st.c_into.setdefault((d, t, v), [])
    r_set = set(st.r_keys)
    for v in range(len(st.mem)):
        p = st.prod[v]
        # a free after the producer matters only for the other outputs of a multi-output op (a single output made
        # and not read in its stage is a useless compute); one after a stage's last op changes no memory in it
        readers = ([p] if p is not None and len(st.outs[p]) > 1 else []) + list(st.users[v])
        for d in sorted(may[v]):
            if st.home.get(v) == d:
                continue
            for t in range(p if p is not None else 0, T):
                last = st.r_at[(d, t)][-1] if st.r_at.get((d, t)) else -1
                ks = [k for k in readers if k <= t and (d, t, k) in r_set]
                if any(k != last for k in ks):
                    st.f_of[(d, t, v)] = ks
                for k in ks:
                    if k != last:
                        st.f_keys.append((d, t, v, k))
                        st.f_at.setdefault((d, t, k), []).append(v)
