"""Between interval solutions and plans: steps in event order (pruned, frees placed, simulator-checked), and a
solver hint (slot starts and ends) from a plan whose first computes follow the model's order."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence

from xsched.contracts.graph import Graph
from xsched.contracts.plan import Compute, Copy, Free, Plan, autograd_boundary, place_frees
from xsched.contracts.result import SolveResult
from xsched.simulate import predicted_plan
from xsched.solve.intervals.data import IntervalData, event
from xsched.solve.milp.extract import free_unwanted_ends, prune

Placement = Mapping[int, tuple[int, tuple[int, ...]]]  # present slot id -> (start event, end of each of its values)


def to_plan(data: IntervalData, placed: Placement, info: SolveResult) -> Plan:
    """The plan of a solution: its steps by event (copies of an event before its computes), pruned, frees after
    last uses, replayed by the simulator within the budgets; an invalid plan is an internal error."""
    g, devs = data.graph, data.devices
    keyed = []
    slot_of: dict[int, int] = {}  # id(step) -> its slot (steps are kept by identity through pruning and frees)
    serial = _read_in_stage(data, placed)
    for sid, (start, _) in placed.items():
        sl = data.slots[sid]
        if sl.kind == "compute":
            keyed.append(((start, 1, False, sl.device, sl.op), Compute(g.ops[sl.op].id, devs[sl.device])))
        else:
            v = sl.values[0]
            step = Copy(g.values[v].id, devs[sl.src], devs[sl.device])
            # a copy read in its own stage first on its link: its reader waits for the copies before it there,
            # and the objective (data.py) counts it whole but the others only beyond the stage's computes
            keyed.append(((start, 0, sid not in serial, sl.device, v), step))
        slot_of[id(keyed[-1][1])] = sid
    keyed.sort(key=lambda x: x[0])
    homes = dict(data.homes)
    outputs = {k for k, v in enumerate(g.values) if v.id in set(g.outputs)}
    wanted = {  # the outputs the solution keeps to the end (another value held there is an unused slack end)
        (g.values[v].id, devs[data.slots[s].device])
        for s, (_, ends) in placed.items()
        for v, e in zip(data.slots[s].values, ends)
        if e == data.end and v in outputs
    }
    wanted |= {(v, d) for v, d in homes.items() if v in set(g.outputs)}
    returned = _returned(data, placed)
    kept = {i for i, sid in slot_of.items() if sid in returned}  # pruning keeps them: nothing may read them
    steps = prune(g, [s for _, s in keyed], wanted, kept)
    steps = free_unwanted_ends(g, place_frees(g, steps, homes), homes, wanted)
    steps = _hold_copy_sources(data, steps, slot_of, placed)
    steps = _hold_to_boundary(data, steps, slot_of, returned)
    plan = Plan(
        graph=g.fingerprint,
        budgets=dict(data.budgets),
        homes=homes,
        steps=tuple(steps),
        solver=info,
        boundary=autograd_boundary(g, steps),
    )
    return predicted_plan(g, plan, data.profile, "the extracted interval plan")


def _read_in_stage(data: IntervalData, placed: Placement) -> set[int]:
    """The placed copy slots whose value a placed compute of their own stage reads on their device."""
    vix = {v.id: k for k, v in enumerate(data.graph.values)}
    reads = {
        (data.stage(start), vix[v], sl.device)
        for sid, (start, _) in placed.items()
        if (sl := data.slots[sid]).kind == "compute"
        for v in data.graph.ops[sl.op].inputs
    }
    return {
        sid
        for sid, (start, _) in placed.items()
        if (sl := data.slots[sid]).kind == "copy" and (data.stage(start), sl.values[0], sl.device) in reads
    }


def _hold_copy_sources(data: IntervalData, steps: Sequence, slot_of: Mapping[int, int], placed: Placement) -> list:
    """Each free of a residency that was copied out moved to where the model ends that residency (a free waits for
    every read, the copy included, and the next compute there waits for the free: freed at its last use, the
    device would wait for the copy; the model counted the memory to its end, so holding it fits the budgets)."""
    g, devs = data.graph, data.devices
    vix = {v.id: k for k, v in enumerate(g.values)}
    keys: list[tuple[int, int, int]] = []  # per step: (event, 0, position), a held free (its hold, 1, position)
    maker: dict[tuple[str, str], int] = {}  # (value, device) -> the slot that made it resident
    copied: set[tuple[str, str]] = set()  # residencies a copy has read since they were made
    at = 0
    for k, st in enumerate(steps):
        if isinstance(st, Free):
            key = (st.value, st.device)
            if key in copied and key in maker:
                sl = data.slots[maker[key]]
                keys.append((max(at, placed[maker[key]][1][sl.values.index(vix[st.value])]), 1, k))
            else:
                keys.append((at, 0, k))
            continue
        sid = slot_of[id(st)]
        at = placed[sid][0]
        keys.append((at, 0, k))
        sl = data.slots[sid]
        made = [(g.values[v].id, devs[sl.device]) for v in sl.values]
        if isinstance(st, Copy):
            copied.add((st.value, st.src))
        for key in made:
            maker[key] = sid
            copied.discard(key)
    return [steps[k] for _, _, k in sorted(keys)]


def _returned(data: IntervalData, placed: Placement) -> dict[int, list[int]]:
    """The placed slots that hold a forward output at the autograd boundary (started before it, ended at or after
    it: boundary.returned_cpsat), with the forward outputs each holds there."""
    held: dict[int, list[int]] = {}
    for sid, (start, ends) in placed.items():
        if start < data.boundary:
            for v, end in zip(data.slots[sid].values, ends):
                if v in data.forward and end >= data.boundary:
                    held.setdefault(sid, []).append(v)
    return held


def _hold_to_boundary(data: IntervalData, steps: Sequence, slot_of: Mapping[int, int], returned) -> list:
    """Each free of a forward output's residency that the model holds across the boundary (`_returned`), placed
    before the boundary step (after the value's last read, by place_frees), moved to just after it: wrap returns
    the value there. The model counts the residency to its end, at or after the boundary, so this fits the budgets."""
    g, devs = data.graph, data.devices
    out = list(steps)
    for sid, values in returned.items():
        made = next((k for k, st in enumerate(out) if slot_of.get(id(st)) == sid), None)
        if made is None:
            continue
        for v in values:
            key = (g.values[v].id, devs[data.slots[sid].device])
            b = autograd_boundary(g, out)
            free = next(
                (
                    k
                    for k in range(made + 1, len(out))
                    if isinstance(out[k], Free) and (out[k].value, out[k].device) == key
                ),
                None,
            )
            if free is not None and b is not None and free < b:
                out.insert(b, out.pop(free))  # b - 1 is the boundary step once the free before it is popped
    return out


def step_counts(graph: Graph, plan: Plan, devices: Sequence[str]) -> dict[tuple, int]:
    """How many times `plan` runs each step, keyed as the model's slots: ("compute", op, device) and ("copy",
    value, src, dst), by index."""
    dix = {d: k for k, d in enumerate(devices)}
    vix = {v.id: k for k, v in enumerate(graph.values)}
    keys = [
        ("compute", graph.op_index[s.op], dix[s.device])
        if isinstance(s, Compute)
        else ("copy", vix[s.value], dix[s.src], dix[s.dst])
        for s in plan.steps
        if not isinstance(s, Free)
    ]
    return dict(Counter(keys))


def hint_from_plan(data: IntervalData, plan: Plan) -> dict[int, tuple[int, tuple[int, ...]]]:
    """Slot placements reproducing `plan` as far as the model allows (empty when its first computes are in another
    order). A recompute lands in the stage of the next first compute (after the last one: stage T); a copy at that
    stage's copy event (after a recompute of stage T: the final copies' event). Steps the slots cannot hold (more
    computes than slots) are left out: the hint is partial and the solver repairs it."""
    g = data.graph
    if tuple(data.graph.op_index[o] for o in plan.first_computes()) != data.order:
        return {}
    pos = {i: q for q, i in enumerate(data.order)}
    dix = {d: k for k, d in enumerate(data.devices)}
    vix = {v.id: k for k, v in enumerate(g.values)}
    by_key: dict[tuple, list[int]] = {}
    for sid, sl in enumerate(data.slots):
        key = ("compute", sl.op, sl.device) if sl.kind == "compute" else ("copy", sl.values[0], sl.src, sl.device)
        by_key.setdefault(key, []).append(sid)
    used: dict[tuple, int] = {}
    open_: dict[tuple[int, int], int] = {}  # (v, d) -> slot holding it now
    placed: dict[int, int] = {}  # slot -> start
    ends: dict[tuple[int, int], int] = {}  # (slot, v) -> end
    stage, last_event = 0, 0
    seen: set[int] = set()
    for s in _reruns_in_position_order(plan.steps, pos, g.op_index):
        if isinstance(s, Free):  # held until the free: to the last event placed before it (a copy out runs)
            r = (vix[s.value], dix[s.device])
            if r in open_:
                ends[(open_[r], r[0])] = max(ends[(open_[r], r[0])], last_event)
            open_.pop(r, None)
            continue
        if isinstance(s, Compute):
            i, d = g.op_index[s.op], dix[s.device]
            first = i not in seen
            seen.add(i)
            if first:
                stage = pos[i]
            ev = (
                event(stage, pos[i], data.width) if first else event(stage + 1, pos[i], data.width)
            )  # a recompute prepares the next stage
            key, made, reads = (
                ("compute", i, d),
                [(vix[v], d) for v in g.ops[i].outputs],
                [(vix[v], d) for v in g.ops[i].inputs],
            )
        else:
            v = vix[s.value]
            ev = event(stage + 1, -1, data.width) if seen else event(0, -1, data.width)
            if ev < last_event and stage + 1 == len(data.order):  # after a recompute of the tail: a final copy
                ev = data.end
            key, made, reads = ("copy", v, dix[s.src], dix[s.dst]), [(v, dix[s.dst])], [(v, dix[s.src])]
        for r in reads:
            if r in open_:
                ends[(open_[r], r[0])] = max(ends[(open_[r], r[0])], ev)
        k = used.get(key, 0)
        if ev < last_event or k >= len(by_key.get(key, ())) or ev not in data.slots[by_key[key][k]].starts:
            continue
        used[key] = k + 1
        sid = by_key[key][k]
        placed[sid] = last_event = ev
        for r in made:
            open_[r] = sid
            ends[(sid, r[0])] = ev
    outputs = {vix[v] for v in g.outputs}
    for (v, _), sid in open_.items():
        if v in outputs:
            ends[(sid, v)] = data.end
    return {sid: (a, tuple(ends[(sid, v)] for v in data.slots[sid].values)) for sid, a in placed.items()}


def _reruns_in_position_order(steps: Sequence, pos: Mapping[int, int], op_index: Mapping[str, int]) -> list:
    """`steps` with the recomputes between two first computes sorted by order position, into the places the
    computes held: a stage of the model runs its recomputes in position order, a plan (gap rematerialization, one
    drop after another) need not. The order is topological, so the sorted recomputes still follow their inputs."""
    out = list(steps)
    seen: set[int] = set()
    spots: list[int] = []

    def settle() -> None:
        for k, step in zip(spots, sorted((out[k] for k in spots), key=lambda c: pos[op_index[c.op]])):
            out[k] = step
        spots.clear()

    for k, step in enumerate(steps):
        if isinstance(step, Compute):
            i = op_index[step.op]
            if i in seen:
                spots.append(k)
                continue
            settle()
            seen.add(i)
    settle()
    return out
