"""The reference interpreter: runs any valid plan step by step, one tensor store per plan device.

It is the correctness reference for every executor and the base of the multi-stream one: each step
kind maps to one function in STEP_RUNNERS. It checks what the simulator checks (inputs resident,
no freeing of graph inputs, outputs resident at the end) and records the bytes resident on each
device after each step, which must equal simulate(...).resident_after.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from xsched.errors import PlanError, XschedError
from xsched.graph import Graph, Op
from xsched.ops import is_random_target, run_op
from xsched.plan import Compute, Copy, Free, Plan, Step, required_homes


@dataclass(frozen=True)
class RunTrace:
    """A finished run: graph outputs (value id -> tensor) and bytes resident per device after each step."""

    outputs: dict[str, torch.Tensor]
    resident_after: tuple[Mapping[str, int], ...]
    recomputed: tuple[str, ...]  # ids of ops computed more than once
    peak_bytes: Mapping[str, int] = field(
        default_factory=dict
    )  # per device, outputs and workspace included (as simulate)


def torch_device(name: str, devices: Mapping[str, torch.device | str] | None = None) -> torch.device:
    """Logical plan device -> torch device: `devices` decides; else "cuda:N" is CUDA and all else is CPU."""
    if devices is not None and name in devices:
        return torch.device(devices[name])
    return torch.device(name) if name.startswith("cuda") else torch.device("cpu")


def is_random(op: Op) -> bool:
    """Ops that draw from the RNG (dropout, bernoulli, rand*): recomputing them must replay the same state."""
    return is_random_target(op.target)


@dataclass
class _State:
    graph: Graph
    plan: Plan
    dev: dict[str, torch.device]
    stores: dict[str, dict[str, torch.Tensor]]
    used: dict[str, int]
    rng: dict[str, tuple[str, torch.Tensor]] = field(
        default_factory=dict
    )  # op id -> (device type, RNG state) before its first run
    computed: dict[str, int] = field(default_factory=dict)
    peak: dict[str, int] = field(default_factory=dict)

    def bump(self, device: str, during: int, step: int, **where: str) -> None:
        """Record memory in use on `device` at some point of `step`; over the plan's budget is an error."""
        self.peak[device] = max(self.peak.get(device, 0), during)
        budget = self.plan.budgets.get(device)
        if budget is not None and during > budget:
            raise PlanError(
                f"memory {during} B exceeds the budget of {budget} B",
                stage="execute",
                step=step,
                device=device,
                **where,
            )


def _get_rng(device: torch.device) -> torch.Tensor:
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def _set_rng(device: torch.device, state: torch.Tensor) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


def _compute(st: _State, s: Compute, i: int) -> None:
    if s.op not in st.graph.op:
        raise PlanError("compute of an unknown op", stage="execute", step=i, op=s.op, device=s.device)
    op = st.graph.op[s.op]
    store = st.stores[s.device]
    for v in op.inputs:
        if v not in store:
            raise PlanError(
                f"input {v} is not resident on {s.device}", stage="execute", step=i, op=op.id, value=v, device=s.device
            )
    outputs_bytes = sum(st.graph.value[v].nbytes for v in op.outputs)
    st.bump(s.device, st.used[s.device] + outputs_bytes + op.workspace_bytes, i, op=op.id)
    device = st.dev[s.device]
    replay = is_random(op) and op.id in st.rng
    if replay:  # recomputation: draw the same numbers as the first run, then continue the stream as before
        kind, state = st.rng[op.id]
        if kind != device.type:
            raise XschedError(
                f"random op first ran on a {kind} device; recomputing it on {device.type} cannot reproduce its numbers",
                stage="execute", step=i, op=op.id, device=s.device,
            )  # fmt: skip
        resume = _get_rng(device)
        _set_rng(device, state)
    elif is_random(op):
        st.rng[op.id] = (device.type, _get_rng(device))
    try:
        outs = run_op(op, store, device)
    except XschedError as e:
        raise XschedError(e.detail, stage="execute", step=i, op=op.id, value=e.value, device=s.device) from e
    finally:
        if replay:
            _set_rng(device, resume)
    for v, t in zip(op.outputs, outs):
        want = st.graph.value[v]
        if not isinstance(t, torch.Tensor) or t.numel() * t.element_size() != want.nbytes:
            got = t.numel() * t.element_size() if isinstance(t, torch.Tensor) else type(t).__name__
            raise XschedError(
                f"{op.target} produced {got} bytes where the graph records {want.nbytes}: the captured shape is wrong",
                stage="execute",
                step=i,
                op=op.id,
                value=v,
            )
        if v not in store:
            st.used[s.device] += want.nbytes
        store[v] = t
    st.computed[op.id] = st.computed.get(op.id, 0) + 1


def _copy(st: _State, s: Copy, i: int) -> None:
    if s.value not in st.graph.value:
        raise PlanError("copy of an unknown value", stage="execute", step=i, value=s.value, device=s.src)
    if s.value not in st.stores[s.src]:
        raise PlanError(f"value is not resident on {s.src}", stage="execute", step=i, value=s.value, device=s.src)
    if s.value in st.stores[s.dst]:
        raise PlanError(f"value is already resident on {s.dst}", stage="execute", step=i, value=s.value, device=s.dst)
    # a real copy even between two logical devices on one torch device, so no store aliases another
    st.stores[s.dst][s.value] = st.stores[s.src][s.value].to(st.dev[s.dst], copy=True)
    st.used[s.dst] += st.graph.value[s.value].nbytes
    st.bump(s.dst, st.used[s.dst], i, value=s.value)


def _free(st: _State, s: Free, i: int) -> None:
    if s.value not in st.stores[s.device]:
        raise PlanError(
            f"free of a value not resident on {s.device}", stage="execute", step=i, value=s.value, device=s.device
        )
    if st.plan.homes.get(s.value) == s.device:
        raise PlanError("graph input freed on its home device", stage="execute", step=i, value=s.value, device=s.device)
    del st.stores[s.device][s.value]
    st.used[s.device] -= st.graph.value[s.value].nbytes


STEP_RUNNERS: dict[type, Callable[[_State, Step, int], None]] = {Compute: _compute, Copy: _copy, Free: _free}  # type: ignore[dict-item]


def execute(
    graph: Graph, plan: Plan, env: Mapping[str, torch.Tensor], devices: Mapping[str, torch.device | str] | None = None
) -> RunTrace:
    """Run `plan` with graph inputs from `env` (value id -> tensor); outputs and the residency trace.

    Memory is checked against `plan.budgets` in graph bytes (Value.nbytes), exactly as `simulate` counts it.
    """
    if plan.graph != graph.fingerprint:
        raise PlanError(f"plan is for graph {plan.graph}, not {graph.fingerprint} ({graph.name})", stage="execute")
    names = plan.devices
    st = _State(
        graph, plan, {d: torch_device(d, devices) for d in names}, {d: {} for d in names}, dict.fromkeys(names, 0)
    )
    for v in graph.inputs:
        if v not in plan.homes:
            raise PlanError("graph input has no home device", stage="execute", value=v)
        if v not in env:
            raise XschedError("no tensor given for graph input", stage="execute", value=v, device=plan.homes[v])
        home = plan.homes[v]
        st.stores[home][v] = env[v].to(st.dev[home])
        st.used[home] += graph.value[v].nbytes
    st.peak = dict(st.used)
    after: list[dict[str, int]] = []
    for i, s in enumerate(plan.steps):
        runner = STEP_RUNNERS.get(type(s))
        if runner is None:
            raise PlanError(f"unknown step {s!r}", stage="execute", step=i)
        runner(st, s, i)
        after.append(dict(st.used))
    return RunTrace(_outputs(st), tuple(after), tuple(o for o, n in st.computed.items() if n > 1), st.peak)


def _outputs(st: _State) -> dict[str, torch.Tensor]:
    n = len(st.plan.steps)
    for op in st.graph.ops:
        if op.id not in st.computed:
            raise PlanError("op is never computed", stage="execute", step=n, op=op.id)
    need = required_homes(st.graph, st.plan.homes)
    out: dict[str, torch.Tensor] = {}
    for v in st.graph.outputs:
        where = [d for d, store in st.stores.items() if v in store]
        if not where:
            raise PlanError("graph output is not resident anywhere at the end", stage="execute", step=n, value=v)
        if v in need and need[v] not in where:
            raise PlanError(f"output must end on {need[v]}", stage="execute", step=n, value=v, device=need[v])
        out[v] = st.stores[need.get(v, where[0])][v]
    return out


def run_plan(
    graph: Graph, plan: Plan, env: Mapping[str, torch.Tensor], devices: Mapping[str, torch.device | str] | None = None
) -> dict[str, torch.Tensor]:
    """Run `plan` step by step; the graph outputs (value id -> tensor). See `execute` for the trace."""
    return execute(graph, plan, env, devices).outputs
