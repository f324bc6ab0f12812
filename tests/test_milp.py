"""The multi-device MILP is optimal on tiny graphs (against an exhaustive search; one or two devices, parking on a
store); the exhaustive searches, graphs and profiles here are shared by the other solvers' tests."""

from __future__ import annotations

import functools
import heapq
import itertools
from collections.abc import Mapping, Sequence

import pytest
from conftest import chain_graph
from oracle import assert_prediction_matches
from oracle import makespan as oracle_makespan

from xsched.contracts.graph import Graph, Op, Value
from xsched.contracts.plan import Compute, Copy, Plan, required_homes
from xsched.contracts.profile import DeviceInfo, LinkCost, OpCost, Profile
from xsched.errors import BudgetError
from xsched.solve.milp.milp import solve_milp
from xsched.solve.objective import objective_floor
from xsched.solve.options import SolverOptions
from xsched.solve.order.order import single_order
from xsched.solve.problem import Problem
from xsched.solve.reference import eager_peak

FAST = SolverOptions(time_limit_s=20.0, mip_gap=0.0)
# a deterministic stop (one thread, a node limit, no clock): the same plan on any machine, however loaded; the
# wall-clock quality targets (random_layered_n100 at 80% in 15 s and 30 s) are scripts/bench_solver.py's
DETERMINISTIC = SolverOptions(time_limit_s=None, node_limit=200, solver_threads=1)


def profile_for(graph: Graph, times: Mapping[str, Mapping[str, float]], links: Mapping[str, LinkCost] = {}) -> Profile:
    """times: device -> op -> seconds (an op missing on a device cannot run there)."""
    return Profile(
        graph.fingerprint,
        {d: DeviceInfo("sim") for d in times},
        {
            d: {o: OpCost(t, energy_j=t * (2.0 if d == "gpu" else 1.0)) for o, t in ts.items()}
            for d, ts in times.items()
        },
        dict(links),
    )


def checked(graph: Graph, plan: Plan, profile: Profile, budgets: Mapping[str, int]) -> Plan:
    """Every plan is for these budgets, its predicted time and peaks are an independent count's (within the budgets),
    and extraction never makes it slower than the MILP's own objective."""
    assert dict(plan.budgets) == dict(budgets)
    assert_prediction_matches(graph, plan, profile, budgets)
    assert plan.solver.method == "milp" and plan.solver.status in ("optimal", "feasible", "time_limit")
    # extraction never makes a plan slower than the stage model says (pruned steps, frees after their stage)
    assert plan.predicted.makespan_s <= plan.solver.stats.model_objective * (1 + 1e-9) + 1e-12
    return plan


def exhaustive_optimum(
    graph: Graph, profile: Profile, budgets: Mapping[str, int], devices: Sequence[str], homes: Mapping[str, str]
) -> float:
    """Least sequential time over ALL step sequences (Dijkstra over residency states), by the simulator's rules."""
    nbytes = {v.id: v.nbytes for v in graph.values}
    end_on = required_homes(graph, homes)
    start = (frozenset(homes.items()), frozenset())
    best = {start: 0.0}
    heap, tie = [(0.0, 0, start)], itertools.count(1)
    while heap:
        cost, _, state = heapq.heappop(heap)
        if cost > best[state]:
            continue
        res, done = state
        if (
            len(done) == len(graph.ops)
            and all(any((v, d) in res for d in devices) for v in graph.outputs)
            and all((v, d) in res for v, d in end_on.items())
        ):
            return cost
        used = {d: sum(nbytes[v] for v, e in res if e == d) for d in devices}
        moves = []
        for op, d in itertools.product(graph.ops, devices):
            c = profile.op_cost(op.id, d)
            if c is None or any((v, d) not in res for v in op.inputs):
                continue
            if d in budgets and used[d] + sum(nbytes[v] for v in op.outputs) + op.workspace_bytes > budgets[d]:
                continue
            moves.append(((res | {(v, d) for v in op.outputs}, done | {op.id}), c.time_s))
        for (v, s), d in itertools.product(res, devices):
            ct = profile.copy_time(v, nbytes[v], s, d) if d != s else None
            if ct is None or (v, d) in res or (d in budgets and used[d] + nbytes[v] > budgets[d]):
                continue
            moves.append(((res | {(v, d)}, done), ct))
        for v, d in res:
            if homes.get(v) != d:
                moves.append(((res - {(v, d)}, done), 0.0))
        for nxt, dt in moves:
            if cost + dt < best.get(nxt, float("inf")) - 1e-12:
                best[nxt] = cost + dt
                heapq.heappush(heap, (cost + dt, next(tie), nxt))
    raise AssertionError("no plan within the budgets")


def exhaustive_staged_optimum(
    graph: Graph, profile: Profile, budgets: Mapping[str, int], devices: Sequence[str], homes: Mapping[str, str]
) -> float:
    """Least makespan in the stage model over ALL step sequences whose first computes follow graph order (the MILP's
    formulation), by a label-setting search over residencies with the open stage's clocks (labels dominated by
    another of the same residency are dropped). A stage is its copies (of values resident when it starts) then its
    computes, up to the first compute of the next op in graph order; the copies after the last op form a last
    stage. It lasts as long as its busiest device (its computes, plus the copies into it that they read) or link
    (its copies); the makespan is the sum of the stages."""
    nbytes = {v.id: v.nbytes for v in graph.values}
    end_on = required_homes(graph, homes)
    lanes = list(devices) + [f"{a}->{b}" for a in devices for b in devices if a != b]
    lane = {x: k for k, x in enumerate(lanes)}
    # a residency is a bit mask over (value, device) pairs: the search hashes and unites millions of them
    places = list(devices) + sorted({d for d in homes.values() if d not in devices})
    pairs = [(v.id, d) for v in graph.values for d in places]
    bit = {p: 1 << i for i, p in enumerate(pairs)}

    def mask(items) -> int:
        return sum(bit[p] for p in set(items))

    def members(res: int):
        while res:
            low = res & -res
            yield pairs[low.bit_length() - 1], low
            res ^= low

    copy_time = functools.cache(lambda v, src, d: profile.copy_time(v, nbytes[v], src, d))
    op_cost = {(k, d): profile.op_cost(op.id, d) for k, op in enumerate(graph.ops) for d in devices}
    reads = {(k, d): mask((v, d) for v in op.inputs) for k, op in enumerate(graph.ops) for d in devices}
    makes = {(k, d): mask((v, d) for v in op.outputs) for k, op in enumerate(graph.ops) for d in devices}
    grows = [sum(nbytes[v] for v in op.outputs) + op.workspace_bytes for op in graph.ops]
    wanted = [mask((v, d) for d in devices) for v in graph.outputs]
    ends = mask(end_on.items())
    # key: residency, ops done, copies arrived in the open stage (value, device, source, charged), computes begun;
    # label: the closed stages' sum and the open stage's clock per lane
    start = (mask(homes.items()), 0, frozenset(), False)
    labels: dict = {start: [(0.0, (0.0,) * len(lanes))]}
    heap, tie = [(0.0, 0, start, 0.0, (0.0,) * len(lanes))], itertools.count(1)

    def push(key, base: float, clocks: tuple) -> None:
        old = labels.get(key, ())
        if any(b <= base + 1e-12 and all(x <= y + 1e-12 for x, y in zip(c, clocks)) for b, c in old):
            return
        kept = [(b, c) for b, c in old if not (base <= b and all(x <= y for x, y in zip(clocks, c)))]
        labels[key] = [*kept, (base, clocks)]
        heapq.heappush(heap, (base + max(clocks), next(tie), key, base, clocks))

    while heap:
        cost, _, key, base, clocks = heapq.heappop(heap)
        if (base, clocks) not in labels.get(key, ()):
            continue  # dominated since it was queued
        res, done, arrived, computing = key
        if done == len(graph.ops) and all(res & w for w in wanted) and res & ends == ends:
            return cost
        held = list(members(res))
        used = dict.fromkeys(devices, 0)
        for (v, d), _ in held:
            if d in used:
                used[d] += nbytes[v]
        for k, op in enumerate(graph.ops[: min(done + 1, len(graph.ops))]):
            for d in devices:
                c = op_cost[k, d]
                if c is None or res & reads[k, d] != reads[k, d]:
                    continue
                if d in budgets and used[d] + grows[k] > budgets[d]:
                    continue
                clk = list(clocks)
                waits = {x for x in arrived if x[1] == d and not x[3] and x[0] in op.inputs}
                clk[lane[d]] += c.time_s + sum(copy_time(v, src, d) for v, _, src, _ in waits)
                nres = res | makes[k, d]
                if k == done:  # the first compute of the next op closes the stage
                    push((nres, done + 1, frozenset(), False), base + max(clk), (0.0,) * len(lanes))
                else:
                    arr = (arrived - waits) | {(v, dd, src, True) for v, dd, src, _ in waits}
                    push((nres, done, frozenset(arr), True), base, tuple(clk))
        if not computing:
            came = {(v, d) for v, d, _, _ in arrived}
            for ((v, src), _), d in itertools.product(held, devices):
                ct = copy_time(v, src, d) if d != src else None
                if ct is None or res & bit[v, d] or (v, src) in came:
                    continue
                if d in budgets and used[d] + nbytes[v] > budgets[d]:
                    continue
                clk = list(clocks)
                clk[lane[f"{src}->{d}"]] += ct
                push((res | bit[v, d], done, arrived | {(v, d, src, False)}, False), base, tuple(clk))
        for (v, d), b in held:
            if homes.get(v) != d:
                push((res ^ b, done, arrived, computing), base, clocks)
    raise AssertionError("no plan within the budgets")


def diamond_graph(train: bool) -> Graph:
    """x -> a -> (b, c) -> d; with train=True, d's gradient flows back through b and c (multi-output ops)."""
    vals = [Value("x", 4, "input"), Value("a", 30), Value("b", 10), Value("c", 20), Value("d", 6)]
    ops = [
        Op("fa", "t", ("x",), ("a",)),
        Op("fb", "t", ("a",), ("b",)),
        Op("fc", "t", ("a",), ("c",)),
        Op("fd", "t", ("b", "c"), ("d",)),
    ]
    outputs = ("d",)
    if train:
        vals += [Value("gb", 10), Value("gc", 20), Value("ga", 30)]
        ops += [
            Op("bd", "t", ("d", "b", "c"), ("gb", "gc"), "bwd"),  # two outputs, like a batch-norm backward
            Op("bbc", "t", ("gb", "gc", "a"), ("ga",), "bwd"),
        ]
        outputs = ("ga",)
    return Graph("diamond", tuple(vals), tuple(ops), outputs)


def times_of(graph: Graph, scale: float = 1.0) -> dict[str, float]:
    return {o.id: scale * (1.0 + (7 * i) % 5) for i, o in enumerate(graph.ops)}


GRAPHS = {
    "chain4": chain_graph([10, 20, 30, 40]),
    "chain3_train": chain_graph([10, 30, 20], train=True),
    "diamond": diamond_graph(False),
    "diamond_train": diamond_graph(True),
}


def tightest_budget(g: Graph, prof: Profile, homes: Mapping[str, str]) -> int:
    """The least one-device budget any plan meets, by exhaustive search."""
    budget = eager_peak(g)
    while True:
        try:
            exhaustive_optimum(g, prof, {"cpu": budget - 1}, ["cpu"], homes)
        except AssertionError:
            return budget
        budget -= 1


def claims_optimal_soundly(g: Graph, prof: Profile, homes: Mapping[str, str], plan: Plan) -> bool:
    """A one-device plan the model proved optimal: "optimal" where graph order is the only order (every plan's first
    computes follow it) or the plan meets the floor on every plan, else "feasible" with the floor as its bound."""
    floor, _ = objective_floor(g, prof, ("cpu",), homes)
    info = plan.solver
    assert info.stats.model_status == "optimal", info.stats
    if single_order(g) or info.objective <= floor * (1 + 1e-9):
        return info.status == "optimal"
    return info.status == "feasible" and info.bound == pytest.approx(floor) and info.gap > 0


@pytest.mark.parametrize("name", sorted(GRAPHS))
@pytest.mark.parametrize("point", ["peak", "between", "tightest", "below"])
def test_one_device_matches_exhaustive_search(name: str, point: str) -> None:
    g = GRAPHS[name]
    prof = profile_for(g, {"cpu": times_of(g)})
    homes = {v: "cpu" for v in g.inputs}
    low, peak = tightest_budget(g, prof, homes), eager_peak(g)
    budgets = {"cpu": {"peak": peak, "between": (low + peak) // 2, "tightest": low, "below": low - 1}[point]}
    if point == "below":
        with pytest.raises(BudgetError, match="cpu"):
            solve_milp(Problem(g, prof, budgets, ["cpu"], homes), FAST)
        return
    want = exhaustive_optimum(g, prof, budgets, ["cpu"], homes)
    plan = checked(g, solve_milp(Problem(g, prof, budgets, ["cpu"], homes), FAST), prof, budgets)
    assert claims_optimal_soundly(g, prof, homes, plan)
    assert plan.predicted.time_s == pytest.approx(want)


@pytest.mark.parametrize("name", ["chain3_train", "diamond"])
def test_two_devices_match_exhaustive_search(name: str) -> None:
    g = GRAPHS[name]
    t = times_of(g)
    # gpu: 4x faster, but op 0 runs only on the cpu; copies cost 0.5 s + bytes / 100
    prof = profile_for(
        g,
        {"cpu": t, "gpu": {o: s / 4 for o, s in t.items() if o != g.ops[0].id}},
        {"cpu->gpu": LinkCost(0.5, 100.0), "gpu->cpu": LinkCost(0.5, 100.0)},
    )
    homes = {v: "cpu" for v in g.inputs}
    peak = eager_peak(g)
    budgets = {"cpu": peak, "gpu": int(peak * 0.6)}
    want = exhaustive_staged_optimum(g, prof, budgets, ["cpu", "gpu"], homes)
    plan = checked(g, solve_milp(Problem(g, prof, budgets, ["cpu", "gpu"], homes), FAST), prof, budgets)
    assert plan.solver.stats.model_objective == pytest.approx(want)
    assert plan.predicted.makespan_s == pytest.approx(oracle_makespan(g, plan, prof))  # the lanes, independently
    assert any(isinstance(s, Copy) for s in plan.steps)


def test_parking_on_a_store_overlaps_the_copies_and_matches_exhaustive_search() -> None:
    """A GPU too small to hold the chain's activations and a CPU that only stores: parking them beats recomputing,
    the copies run while the GPU computes (the plan's makespan is below its sequential time), and the MILP's stage
    makespan is the exhaustive optimum of its formulation."""
    g = chain_graph([30, 20, 40], train=True)
    t = times_of(g)
    quick = LinkCost(0.05, 200.0)  # a 20-40 B activation moves in 0.15-0.25 s, under one op
    prof = profile_for(g, {"gpu": t, "cpu": {}}, {"gpu->cpu": quick, "cpu->gpu": quick})
    homes = {"x": "gpu"}
    budgets = {"gpu": 108, "cpu": 1000}  # the eager peak is 138 B; one device alone must recompute here
    want = exhaustive_staged_optimum(g, prof, budgets, ["gpu", "cpu"], homes)
    plan = checked(g, solve_milp(Problem(g, prof, budgets, ["gpu", "cpu"], homes), FAST), prof, budgets)
    assert plan.solver.stats.model_objective == pytest.approx(want)
    assert any(isinstance(s, Copy) and s.dst == "cpu" for s in plan.steps)
    assert plan.predicted.makespan_s == pytest.approx(oracle_makespan(g, plan, prof))
    assert plan.predicted.makespan_s < plan.predicted.time_s - 0.1  # copies hidden behind compute
    alone = exhaustive_optimum(g, profile_for(g, {"gpu": t}), {"gpu": 108}, ["gpu"], homes)  # 17 s: it recomputes
    assert plan.predicted.makespan_s < alone - 0.5


def test_free_copies_and_two_equal_devices_are_no_worse_than_one() -> None:
    g = chain_graph([10, 30, 20, 40], train=True)
    t = times_of(g)
    free = LinkCost(0.0, 1e30)
    prof = profile_for(g, {"a": t, "b": t}, {"a->b": free, "b->a": free})
    homes = {v: "a" for v in g.inputs}
    budget = 112  # the one-device optimum recomputes at 112 B (eager peak 148 B)
    one = checked(g, solve_milp(Problem(g, prof, {"a": budget}, ["a"], homes), FAST), prof, {"a": budget})
    two = checked(
        g,
        solve_milp(Problem(g, prof, {"a": budget, "b": budget}, ["a", "b"], homes), FAST),
        prof,
        {"a": budget, "b": budget},
    )
    assert two.predicted.time_s <= one.predicted.time_s + 1e-9
    assert one.predicted.time_s > sum(t.values())  # one device must recompute; two need not
    assert two.predicted.time_s == pytest.approx(sum(t.values()))


def test_expensive_link_stays_on_one_device() -> None:
    g = GRAPHS["diamond_train"]
    t = times_of(g)
    slow = LinkCost(1e4, 1.0)
    prof = profile_for(g, {"cpu": t, "gpu": {o: s / 2 for o, s in t.items()}}, {"cpu->gpu": slow, "gpu->cpu": slow})
    budgets = {"cpu": eager_peak(g), "gpu": eager_peak(g)}
    plan = checked(g, solve_milp(Problem(g, prof, budgets, ["cpu", "gpu"], {"x": "cpu"}), FAST), prof, budgets)
    assert not any(isinstance(s, Copy) for s in plan.steps)
    assert {s.device for s in plan.steps if isinstance(s, Compute)} == {"cpu"}
