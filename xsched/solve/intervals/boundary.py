"""The autograd boundary's two rules in the interval model, for both backends (CP-SAT and the linearised HiGHS
model): every forward output resident when backward starts (wrap returns them there: `missing_at_boundary`), and
the caller's held outputs resident from then to the end (`hold_to_end`). Modelled rather than checked after the
solve, where a plan breaking the first was dropped (intervals-cpsat's refinement of hier's plan on GPT-2 at 45%)."""

from __future__ import annotations

from xsched.solve.intervals.data import IntervalData


def before_boundary(data: IntervalData, v: int) -> list[int]:
    """The slots of value `v` (every device) that may start before the boundary: those that can hold it there."""
    return [
        k
        for d in range(len(data.devices))
        for k in data.of_value.get((v, d), ())
        if data.slots[k].starts[0] < data.boundary
    ]


def copies_event(data: IntervalData) -> int:
    """The boundary stage's copy event: a tangent copied there starts backward before the boundary compute."""
    return 1 + data.stage(data.boundary) * data.width


def tangent_copies(data: IntervalData) -> list[int]:
    """The copy slots of tangents that may start at or before the boundary stage's copies (autograd_boundary: a
    step touching a tangent starts backward)."""
    first = copies_event(data)
    return [
        k
        for k, sl in enumerate(data.slots)
        if sl.kind == "copy" and data.graph.values[sl.values[0]].kind == "tangent" and sl.starts[0] <= first
    ]


def held_cpsat(m, data: IntervalData, a: list, s: list, e: dict) -> None:
    """Each held output: some slot started before the boundary holds it to the end, and a slot holding it at the
    boundary is never ended before the end (hold_to_end's pinned residencies)."""
    for v in data.held:
        across = []
        for k in before_boundary(data, v):
            before, kept = m.NewBoolVar(f"before{k}"), m.NewBoolVar(f"kept{k}")
            m.Add(s[k] < data.boundary).OnlyEnforceIf(before)
            m.Add(s[k] >= data.boundary).OnlyEnforceIf(before.Not())
            m.Add(e[(k, v)] >= data.boundary).OnlyEnforceIf(kept)
            m.Add(e[(k, v)] < data.boundary).OnlyEnforceIf(kept.Not())
            m.Add(e[(k, v)] == data.end).OnlyEnforceIf([a[k], before, kept])  # held at the boundary: to the end
            both = m.NewBoolVar(f"across{k}")  # k holds v from before the boundary to the end
            m.AddBoolAnd([a[k], before, kept]).OnlyEnforceIf(both)
            across.append(both)
        if across:  # else its producer comes after the boundary in this order: nothing held (as hold_to_end)
            m.AddBoolOr(across)


def returned_cpsat(m, data: IntervalData, a: list, s: list, e: dict) -> None:
    """Each forward output held at the first backward compute by a slot started before it. No tangent copy comes
    before the boundary stage's copies, and one among them (`early`) needs the holding slot started before them."""
    if not data.forward:
        return
    copies = copies_event(data)
    tangent = tangent_copies(data)
    early = m.NewBoolVar("tangent_copied_first") if tangent else None  # a tangent copy among those copies
    for k in tangent:
        m.Add(s[k] >= copies).OnlyEnforceIf(a[k])
        m.Add(s[k] > copies).OnlyEnforceIf([a[k], early.Not()])
    for v in data.forward:
        across = []
        for k in before_boundary(data, v):
            lit = m.NewBoolVar(f"returned{k}_{v}")
            m.AddImplication(lit, a[k])
            m.Add(s[k] < data.boundary).OnlyEnforceIf(lit)
            m.Add(e[(k, v)] >= data.boundary).OnlyEnforceIf(lit)
            if early is not None:
                m.Add(s[k] < copies).OnlyEnforceIf([lit, early])
            across.append(lit)
        if across:  # else its producer comes after the boundary in this order: validated() repairs or refuses it
            m.AddBoolOr(across)


def held_highs(m, data: IntervalData, s) -> None:
    """held_cpsat, linearised (b: started before the boundary, c: held at it)."""
    import pyomo.environ as pyo

    B, M, end = data.boundary, data.end + 1, data.end
    keys = [(k, v) for v in data.held for k in before_boundary(data, v)]
    m.held_b = pyo.Var(keys, domain=pyo.Binary)  # held_b[k, v]: slot k starts before the boundary (or is unused)
    m.held_c = pyo.Var(keys, domain=pyo.Binary)  # held_c[k, v]: slot k holds v at the boundary
    m.held = pyo.ConstraintList()  # a held output resident from the boundary to the end
    for k, v in keys:
        b, c, a, e = m.held_b[k, v], m.held_c[k, v], m.a[k], m.e[k, v]
        m.held.add(s(k) >= B - M * b)  # started before the boundary: b
        m.held.add(c <= a)
        m.held.add(c <= b)
        m.held.add(s(k) <= B - 1 + M * (1 - c))
        m.held.add(e >= B * c)
        m.held.add(e <= B - 1 + M * (c + 2 - a - b))  # used, started before and still held at it: c
        m.held.add(e >= end - M * (1 - c))  # ... then held to the end
    for v in data.held:  # none before the boundary: its producer comes after it in this order, nothing is held
        if any(w == v for _, w in keys):
            m.held.add(sum(m.held_c[k, w] for k, w in keys if w == v) >= 1)


def returned_highs(m, data: IntervalData, s) -> None:
    """returned_cpsat, linearised: returned[k, v], slot k holds forward output v from before the first backward
    compute to it; early, a tangent copy among the boundary stage's copies."""
    import pyomo.environ as pyo

    if not data.forward:
        return
    B, M, copies = data.boundary, data.end + 1, copies_event(data)
    keys = [(k, v) for v in data.forward for k in before_boundary(data, v)]
    m.returned = pyo.Var(keys, domain=pyo.Binary)
    m.early = pyo.Var(domain=pyo.Binary)
    m.boundary = pyo.ConstraintList()
    for k in tangent_copies(data):
        m.boundary.add(s(k) >= copies - M * (1 - m.a[k]))
        m.boundary.add(s(k) >= copies + 1 - M * (1 - m.a[k]) - M * m.early)
    for k, v in keys:
        r = m.returned[k, v]
        m.boundary.add(r <= m.a[k])
        m.boundary.add(s(k) <= B - 1 + M * (1 - r))
        m.boundary.add(m.e[k, v] >= B * r)
        m.boundary.add(s(k) <= copies - 1 + M * (2 - r - m.early))
    for v in data.forward:  # none before the boundary: its producer comes after it in this order (validated)
        if any(w == v for _, w in keys):
            m.boundary.add(sum(m.returned[k, w] for k, w in keys if w == v) >= 1)
