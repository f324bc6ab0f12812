"""The plan (contract 3, docs/ARCHITECTURE.md): frozen steps, the solver's record, JSON, and placing frees after last
uses."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union

from xsched.contracts.graph import Graph, read_text
from xsched.contracts.result import SolveResult, result_from_dict
from xsched.errors import PlanError

SCHEMA = "xsched.plan/1"


@dataclass(frozen=True)
class Compute:
    """Run op `op` on `device`; its outputs become resident there."""

    op: str
    device: str


@dataclass(frozen=True)
class Copy:
    """Copy `value` from `src` to `dst`; it becomes resident on `dst` too."""

    value: str
    src: str
    dst: str


@dataclass(frozen=True)
class Free:
    """End the residency of `value` on `device`."""

    value: str
    device: str


Step = Union[Compute, Copy, Free]


@dataclass(frozen=True)
class Prediction:
    """What the simulator predicts for the plan."""

    time_s: float | None
    peak_bytes: Mapping[str, int]
    energy_j: float | None = None
    makespan_s: float | None = None


@dataclass(frozen=True)
class Plan:
    """Steps over devices for one graph, under per-device budgets (bytes; absent = unlimited)."""

    graph: str  # graph fingerprint
    budgets: Mapping[str, int]
    homes: Mapping[str, str]  # graph input value id -> device
    steps: tuple[Step, ...]
    solver: SolveResult  # the record of the run that found it (its `plan` field is None)
    predicted: Prediction | None = None
    boundary: int | None = None  # index of the first step after the autograd boundary (training)
    extra: Mapping[str, Any] = field(default_factory=dict)

    def first_computes(self) -> tuple[str, ...]:
        """The op ids in the order the plan first computes them: the order it chose."""
        return tuple(dict.fromkeys(s.op for s in self.steps if isinstance(s, Compute)))

    @property
    def devices(self) -> tuple[str, ...]:
        seen = dict.fromkeys(self.budgets)
        seen.update(dict.fromkeys(self.homes.values()))
        for s in self.steps:
            if isinstance(s, Copy):
                seen.update(dict.fromkeys((s.src, s.dst)))
            else:
                seen[s.device] = None
        return tuple(seen)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "schema": SCHEMA,
            "graph": self.graph,
            "budgets": dict(self.budgets),
            "homes": dict(self.homes),
            "steps": [step_to_dict(s) for s in self.steps],
            "solver": self.solver.to_dict(),
        }
        if self.predicted is not None:
            p = self.predicted
            d["predicted"] = {"time_s": p.time_s, "peak_bytes": dict(p.peak_bytes), "energy_j": p.energy_j}
            if p.makespan_s is not None:
                d["predicted"]["makespan_s"] = p.makespan_s
        if self.boundary is not None:
            d["boundary"] = self.boundary
        d.update(self.extra)
        return d

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> Plan:
        if not isinstance(d, Mapping) or d.get("schema") != SCHEMA:
            got = d.get("schema") if isinstance(d, Mapping) else type(d).__name__
            raise PlanError(f"unknown plan schema {got!r}, expected {SCHEMA!r}", stage="plan")
        try:
            solver = result_from_dict(d.get("solver") or {"method": "unknown"})
            p = d.get("predicted")
            predicted = (
                Prediction(p.get("time_s"), dict(p.get("peak_bytes", {})), p.get("energy_j"), p.get("makespan_s"))
                if p
                else None
            )
            known = {"schema", "graph", "budgets", "homes", "steps", "solver", "predicted", "boundary"}
            return Plan(
                graph=str(d["graph"]),
                budgets={k: int(v) for k, v in d["budgets"].items()},
                homes={str(k): str(v) for k, v in d["homes"].items()},
                steps=tuple(step_from_dict(x, i) for i, x in enumerate(d["steps"])),
                solver=solver,
                predicted=predicted,
                boundary=d.get("boundary"),
                extra={k: v for k, v in d.items() if k not in known},
            )
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise PlanError(f"malformed plan JSON: {type(e).__name__}: {e}", stage="plan") from e

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")

    @staticmethod
    def load(path: str | Path) -> Plan:
        try:
            d = json.loads(read_text(path))
        except (OSError, json.JSONDecodeError, UnicodeDecodeError, EOFError) as e:
            raise PlanError(f"cannot read plan file {path}: corrupt or unreadable ({e})", stage="plan") from e
        return Plan.from_dict(d)


def step_to_dict(s: Step) -> dict[str, str]:
    if isinstance(s, Compute):
        return {"do": "compute", "op": s.op, "device": s.device}
    if isinstance(s, Copy):
        return {"do": "copy", "value": s.value, "src": s.src, "dst": s.dst}
    return {"do": "free", "value": s.value, "device": s.device}


def step_from_dict(d: Mapping[str, Any], index: int) -> Step:
    kind = d.get("do")
    if kind == "compute":
        return Compute(str(d["op"]), str(d["device"]))
    if kind == "copy":
        return Copy(str(d["value"]), str(d["src"]), str(d["dst"]))
    if kind == "free":
        return Free(str(d["value"]), str(d["device"]))
    raise PlanError(f"unknown step kind {kind!r}", stage="plan", step=index)


def rng_domain(device: str) -> str:
    """The RNG a plan device draws from: "cuda:N" draws from that GPU's generator, every other device from the
    CPU's. A random op recomputed in another domain cannot replay its first run's draws."""
    return device if device.startswith("cuda") else "cpu"


def ends_on_one_device(graph: Graph, homes: Mapping[str, str]) -> set[str]:
    """The values that must be resident at the end when the plan has one device: every graph output (it must end
    somewhere, and there is nowhere else) and every required home."""
    return set(graph.outputs) | set(required_homes(graph, homes))


def required_homes(graph: Graph, homes: Mapping[str, str]) -> dict[str, str]:
    """Output value -> the device where it must be resident at the end (param grads, buffer updates)."""
    need: dict[str, str] = {}
    for v in graph.values:
        target = v.grad_of or v.updates
        if target is not None and v.id in graph.outputs and target in homes:
            need[v.id] = homes[target]
    return need


def place_frees(graph: Graph, steps: Sequence[Step], homes: Mapping[str, str]) -> tuple[Step, ...]:
    """Drop the frees in `steps` and free every residency right after its last use instead.

    A residency of value v on device d lasts from the step that makes v resident on d until the
    next step that makes it resident there again (a recompute) or the end. It is freed after its
    last read (a compute reading v on d, or a copy out of d); one that reaches the end is kept if v
    is a graph output needed there, and graph inputs are never freed on their home.
    """
    body = [s for s in steps if not isinstance(s, Free)]
    must_end_on = required_homes(graph, homes)
    outputs = set(graph.outputs)
    # residency key (value, device) -> index in `body` of its latest start and of its latest read
    start: dict[tuple[str, str], int] = {(v, d): -1 for v, d in homes.items()}
    last_read: dict[tuple[str, str], int] = {}
    free_after: dict[int, list[tuple[str, str]]] = {}

    def close(key: tuple[str, str]) -> None:
        v, d = key
        if homes.get(v) == d:
            return
        free_after.setdefault(last_read.get(key, start[key]), []).append(key)

    for i, s in enumerate(body):
        if isinstance(s, Compute):
            op = graph.op[s.op]
            for v in op.inputs:
                last_read[(v, s.device)] = i
            made = [(v, s.device) for v in op.outputs]
        else:
            last_read[(s.value, s.src)] = i
            made = [(s.value, s.dst)]
        for key in made:
            if key in start:
                close(key)
            start[key] = i
            last_read.pop(key, None)
    for key in list(start):
        v, d = key
        if v in outputs and must_end_on.get(v, d) == d:
            continue
        close(key)
    out: list[Step] = []
    for key in free_after.pop(-1, []):
        out.append(Free(*key))
    for i, s in enumerate(body):
        out.append(s)
        out.extend(Free(v, d) for v, d in free_after.get(i, []))
    return tuple(out)


def autograd_boundary(graph: Graph, steps: Sequence[Step]) -> int | None:
    """Index of the first step that belongs to backward: it computes a bwd op or touches a tangent.

    None for a graph with no backward (inference). Steps before it run in the wrapper's forward.
    """
    tangents = {v.id for v in graph.values if v.kind == "tangent"}
    if not tangents and all(o.phase != "bwd" for o in graph.ops):
        return None
    for i, s in enumerate(steps):
        if isinstance(s, Compute):
            op = graph.op[s.op]
            if op.phase == "bwd" or tangents.intersection(op.inputs):
                return i
        elif s.value in tangents:
            return i
    return len(steps)
