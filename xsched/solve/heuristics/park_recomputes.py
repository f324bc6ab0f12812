"""Recomputes traded for parks: a one-device plan's reruns replaced, where its store's links have room, by a copy of
the value to the store after it was made and back ahead of the read the rerun served (the reruns that only fed it
dropped too). Checkpointing and gap rematerialization recompute whatever they free, however dear; a matmul's output
(tens of MiB, half a millisecond to make again) moves in about as long over a 56 GB/s link that the step otherwise
leaves idle. GPT-2 (6 layers, batch 8, T1024, the loss in 8 blocks, modelled H100) at 25% with its logits held
through backward: the best plan (checkpoint's) recomputes 32 ms of its 157 ms step on the GPU alone, its link
unused; traded, 19 ms of 146 ms (1.308x -> 1.216x eager, docs/BENCHMARKS.md)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

from xsched.contracts.graph import Graph
from xsched.contracts.plan import Compute, Copy, Free, Plan, Step, place_frees
from xsched.contracts.profile import Profile
from xsched.contracts.result import HeuristicStats
from xsched.errors import BudgetError
from xsched.solve.heuristics.checkpoint import checkpoint_search
from xsched.solve.heuristics.routing import finish
from xsched.solve.heuristics.timeline import op_seconds
from xsched.solve.objective import better
from xsched.solve.options import DEFAULTS, SolverOptions, keeps_limit, out_of_time
from xsched.solve.problem import Problem, runnable

METHOD = "park-recomputes"
LEAD = 1.5  # a copy back is issued this many times its own time ahead of the read it serves (the link is shared)
BATCH = 4  # trades tried together before one at a time: each try replays the whole plan


@dataclass(frozen=True)
class Trade:
    """Rerun `index` of `body` (its steps less frees) replaced by copies: each of its outputs read later goes to the
    store after the body index that made it (None where the store holds it already) and comes back after its last
    use there and before the rerun's index; `saved` is the rerun's time, `moved` the bytes copied back."""

    index: int
    copies: tuple[tuple[str, int | None, int, int], ...]  # (value, out_after, last use before, back_before)
    saved: float
    moved: int


def compute_device(plan: Plan) -> str | None:
    """The one device that computes in `plan` (None when several do)."""
    devices = {s.device for s in plan.steps if isinstance(s, Compute)}
    return next(iter(devices)) if len(devices) == 1 else None


def reruns(graph: Graph, body: Sequence[Step]) -> list[int]:
    """Indices in `body` of the computes of an op run before."""
    seen: set[str] = set()
    out = []
    for i, s in enumerate(body):
        if isinstance(s, Compute):
            if s.op in seen:
                out.append(i)
            seen.add(s.op)
    return out


def trades(graph: Graph, body: Sequence[Step], device: str, store: str, cost: Mapping[str, float]) -> list[Trade]:
    """Each rerun on `device` whose outputs read after it were made there before, as a Trade, dearest time per byte
    moved first; a rerun of an output with no earlier residency to copy from (none) is left."""
    found = []
    for j in reruns(graph, body):
        s = body[j]
        assert isinstance(s, Compute)
        if s.device != device:
            continue
        copies = []
        for v in graph.op[s.op].outputs:
            if not read_after(graph, body, j, v, device):
                continue
            made = made_before(graph, body, j, v, device)
            if made is None:
                break
            out = None if _on_store(body, made, j, v, store) else made
            copies.append((v, out, _last_use(graph, body, made, j, v, device), j))
        else:
            moved = sum(graph.value[v].nbytes for v, *_ in copies)
            found.append(Trade(j, tuple(copies), cost[s.op], moved))
    return sorted(found, key=lambda t: (-t.saved / max(t.moved, 1), t.index))


def read_after(graph: Graph, steps: Sequence[Step], j: int, v: str, device: str) -> bool:
    """`v` is read on `device` after step `j` before it is made or freed there again (a copy out counts as a read),
    or is a graph output left there."""
    for s in steps[j + 1 :]:
        if isinstance(s, Compute) and s.device == device and v in graph.op[s.op].inputs:
            return True
        if isinstance(s, Copy) and s.value == v and s.src == device:
            return True
        if makes(graph, s, v, device) or (isinstance(s, Free) and s.value == v and s.device == device):
            return False
    return v in graph.outputs


def made_before(graph: Graph, body: Sequence[Step], j: int, v: str, device: str) -> int | None:
    """The index of the latest step before `j` that made `v` on `device` (a compute or a copy there)."""
    for i in range(j - 1, -1, -1):
        s = body[i]
        if isinstance(s, Compute) and s.device == device and v in graph.op[s.op].outputs:
            return i
        if isinstance(s, Copy) and s.value == v and s.dst == device:
            return i
    return None


def _last_use(graph: Graph, body: Sequence[Step], made: int, j: int, v: str, device: str) -> int:
    """The index of the last step in [made, j) that makes or reads `v` on `device`: its copy back comes after it
    (the residency there is freed after that read)."""
    for i in range(j - 1, made, -1):
        s = body[i]
        if (isinstance(s, Compute) and s.device == device and v in graph.op[s.op].inputs) or (
            isinstance(s, Copy) and s.value == v and device in (s.src, s.dst)
        ):
            return i
    return made


def _on_store(body: Sequence[Step], made: int, j: int, v: str, store: str) -> bool:
    """A copy of `v` to `store` runs between `made` and `j` (frees are placed again after the last read, so it is
    still there)."""
    return any(isinstance(s, Copy) and s.value == v and s.dst == store for s in body[made:j])


def apply_trades(
    graph: Graph,
    body: Sequence[Step],
    chosen: Sequence[Trade],
    device: str,
    store: str,
    profile: Profile,
    cost: Mapping[str, float],
    homes: Mapping[str, str],
    lead: float = LEAD,
) -> list[Step]:
    """`body` with each chosen rerun removed and the reruns left unread removed, its copies added, and frees after
    last uses except each traded value's on `device`, which waits until its copy out is due done: freed right
    after its copy out, the next compute would wait for the copy (xsched.lanes). Times are the computes' own
    back to back (`cost`), the copies' from the profile; a copy back is issued `lead` x its time ahead of the read
    it serves, after the value's last use there."""
    drop = {t.index for t in chosen}
    at = _compute_clock(graph, body, device, cost, drop)
    computes = [i for i, s in enumerate(body) if isinstance(s, Compute) and s.device == device and i not in drop]
    out_after: dict[int, list[str]] = {}
    back_before: dict[int, list[str]] = {}
    free_after: dict[tuple[str, int], int] = {}  # (value, its copy out's body index) -> compute to free it after
    made_copies: dict[tuple[str, int], Copy] = {}
    for t in chosen:
        for v, out, used, serves in t.copies:
            need_out = profile.copy_time(v, graph.value[v].nbytes, device, store) or 0.0
            need_back = profile.copy_time(v, graph.value[v].nbytes, store, device) or 0.0
            first = next(i for i in computes if i > used) if any(i > used for i in computes) else serves
            back = max(
                (i for i in computes if first <= i <= serves and at[i] <= at[serves] - lead * need_back), default=first
            )
            back_before.setdefault(back, []).append(v)
            if out is not None:
                out_after.setdefault(out, []).append(v)
                done = at[out] + cost.get(getattr(body[out], "op", ""), 0.0) + need_out
                later = [i for i in computes if out < i < back and at[i] + cost[body[i].op] >= done]
                free_after[(v, out)] = later[0] if later else max((i for i in computes if out < i < back), default=out)
    steps: list[Step] = []
    for i, s in enumerate(body):
        steps += [Copy(v, store, device) for v in dict.fromkeys(back_before.get(i, ()))]
        if i not in drop:
            steps.append(s)
        for v in dict.fromkeys(out_after.get(i, ())):
            made_copies[(v, i)] = Copy(v, device, store)
            steps.append(made_copies[(v, i)])
    placed = list(place_frees(graph, _without_unread_reruns(graph, steps, device), homes))
    for key, copy in made_copies.items():
        _defer_free(graph, placed, copy, body[free_after[key]])
    return placed


def _defer_free(graph: Graph, steps: list[Step], copy: Copy, after: Step) -> None:
    """Move the free of `copy`'s value on its source that follows the copy (before the value is made there again)
    to right after the step `after` (both found by identity), where that is later and before such a making."""
    q = next((k for k, s in enumerate(steps) if s is copy), None)
    if q is None:
        return
    v, d = copy.value, copy.src
    f = None
    for k in range(q + 1, len(steps)):
        s = steps[k]
        if isinstance(s, Free) and s.value == v and s.device == d:
            f = k
            break
        if makes(graph, s, v, d):
            return
    t = next((k for k, s in enumerate(steps) if s is after), None)
    if f is None or t is None or t <= f or any(makes(graph, s, v, d) for s in steps[f + 1 : t + 1]):
        return
    steps.insert(t + 1, steps[f])
    del steps[f]


def makes(graph: Graph, s: Step, v: str, d: str) -> bool:
    return (isinstance(s, Compute) and s.device == d and v in graph.op[s.op].outputs) or (
        isinstance(s, Copy) and s.value == v and s.dst == d
    )


def _compute_clock(
    graph: Graph, body: Sequence[Step], device: str, cost: Mapping[str, float], drop: set[int]
) -> dict[int, float]:
    """Each body index -> the time its step starts when `device`'s computes (less `drop`) run back to back."""
    clock, at = 0.0, {}
    for i, s in enumerate(body):
        at[i] = clock
        if isinstance(s, Compute) and s.device == device and i not in drop:
            clock += cost[s.op]
    return at


def _without_unread_reruns(graph: Graph, steps: list[Step], device: str) -> list[Step]:
    """`steps` less the reruns none of whose outputs is read before it is made again (they fed a removed rerun)."""
    while True:
        dead = [j for j in reruns(graph, steps) if _unread(graph, steps, j, device)]
        if not dead:
            return steps
        gone = set(dead)
        steps = [s for i, s in enumerate(steps) if i not in gone]


def _unread(graph: Graph, steps: Sequence[Step], j: int, device: str) -> bool:
    """Compute `j` on `device` makes nothing read before it is made there again (nor a graph output)."""
    s = steps[j]
    assert isinstance(s, Compute)
    return s.device == device and not any(read_after(graph, steps, j, v, device) for v in graph.op[s.op].outputs)


def plan_of(
    graph: Graph, placed: Sequence[Step], plan: Plan, device: str, profile: Profile, budgets: Mapping[str, int]
) -> Plan:
    """The steps as a plan checked by the simulator under the budgets (the hold and the autograd boundary rule
    counted: `runnable`); BudgetError when over."""
    recomputes = sum(isinstance(s, Compute) for s in placed) - len(graph.ops)
    parked = sum(isinstance(s, Copy) and s.src == device for s in placed)
    stats = HeuristicStats(device=device, recomputes=recomputes, parked=parked)
    homes = dict(plan.homes)
    # the budgets checked untimed first (most tries that fail, fail there), then the one timed replay, with the hold
    checked = finish(graph, placed, METHOD, budgets, homes, profile, 0.0, lanes=False, stats=stats)
    return runnable(graph, checked, profile, budgets)


def park_recomputes(
    graph: Graph,
    plan: Plan,
    store: str,
    profile: Profile,
    budgets: Mapping[str, int],
    stop: Callable[[], bool] = lambda: False,
    alpha: float = 0.0,
) -> Plan | None:
    """`plan` with the reruns whose trades for parks make it faster and fit the budgets (BATCH at a time, dearest
    time per byte first, a batch that does not help tried one trade at a time), or None when none does. `stop`
    ends the search between two tries (each replays the plan)."""
    device = compute_device(plan)
    if device is None or device == store or profile.link(device, store) is None or profile.link(store, device) is None:
        return None
    body = [s for s in plan.steps if not isinstance(s, Free)]
    cost = op_seconds(graph, device, profile)
    cands = trades(graph, body, device, store, cost)
    best, chosen = plan, []

    def attempt(more: Sequence[Trade]) -> bool:
        nonlocal best, chosen
        try:
            steps = apply_trades(graph, body, [*chosen, *more], device, store, profile, cost, plan.homes)
            p = plan_of(graph, steps, plan, device, profile, budgets)
        except BudgetError:
            return False
        if not better(p, best, alpha):
            return False
        best, chosen = p, [*chosen, *more]
        return True

    for k in range(0, len(cands), BATCH):
        batch = cands[k : k + BATCH]
        if stop():
            break
        if attempt(batch) or len(batch) == 1:
            continue
        for t in batch:
            if stop():
                break
            attempt([t])
    return best if chosen else None


@keeps_limit
def park_recomputes_search(problem: Problem, options: SolverOptions = DEFAULTS, warm: Plan | None = None) -> Plan:
    """`park-recomputes`: a plan's reruns traded for parks on each store its compute device has links both ways
    with, within the time limit: the best plan so far among the heuristics (auto, heuristics: `SolverEntry.refines`),
    else the caller's warm start, else the checkpoint heuristic's. That plan itself where it computes on several
    devices or no trade makes it faster (relabelled); BudgetError where there is none."""
    start = warm if warm is not None else checkpoint_search(problem, options)
    best = start
    if (device := compute_device(start)) is not None:
        graph, profile = problem.graph, problem.profile
        for store in (s for s in problem.devices if s != device):
            alpha = options.alpha_energy
            found = park_recomputes(graph, start, store, profile, problem.budgets, stop=out_of_time, alpha=alpha)
            if found is not None and better(found, best, options.alpha_energy):
                best = found
    return replace(best, solver=replace(best.solver, method=METHOD, status="heuristic"))
