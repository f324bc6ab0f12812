"""The reference interpreter: runs any valid plan step by step, one tensor store per plan device.

It is the correctness reference for every executor: the walk and its rules are `xsched.interpret`'s (the same
as the simulator's), and its hooks move tensors. It records the bytes resident on each device after each step,
which must equal simulate(...).resident_after.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from xsched.contracts.graph import Graph, Op
from xsched.contracts.plan import Compute, Copy, Free, Plan, Step
from xsched.contracts.random_ops import is_random_target
from xsched.contracts.torch_ops import run_op
from xsched.errors import XschedError
from xsched.execute.rng import get_rng, set_rng
from xsched.interpret import PlanInterpreter, at_step, wrong_size


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


def device_present(name: str, devices: Mapping[str, torch.device | str] | None = None) -> torch.device:
    """`torch_device(name, devices)`, refused in one line where it is a CUDA device this machine does not have (a
    plan made for a GPU, run on a host without one)."""
    dev = torch_device(name, devices)
    if dev.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if (dev.index or 0) >= count:
            raise XschedError(
                f"the plan runs on {name} ({dev}), and this machine has {count} CUDA device(s): run it where that GPU "
                "is, or plan again for these devices",
                stage="execute",
                device=name,
            )
    return dev


def is_random(op: Op) -> bool:
    """Ops that draw from the RNG (dropout, bernoulli, rand*): recomputing them must replay the same state."""
    return is_random_target(op.target)


class ReferenceRun(PlanInterpreter):
    """The interpreter's walk with tensors: each compute runs its op on its device's store, each copy makes a
    real copy, each free drops the tensor. Memory is checked against the plan's budgets in graph bytes."""

    stage = "execute"

    def __init__(
        self,
        graph: Graph,
        plan: Plan,
        env: Mapping[str, torch.Tensor],
        devices: Mapping[str, torch.device | str] | None,
    ) -> None:
        super().__init__(graph, plan, check_budgets=True)
        self.dev = {d: device_present(d, devices) for d in self.devices}
        self.stores: dict[str, dict[str, torch.Tensor]] = {d: {} for d in self.devices}
        self.rng: dict[str, tuple[str, torch.Tensor]] = {}  # op id -> (device type, RNG state) before its first run
        self.after: list[dict[str, int]] = []
        for v in graph.inputs:
            if v not in env:
                raise XschedError("no tensor given for graph input", stage="execute", value=v, device=plan.homes[v])
            home = plan.homes[v]
            self.stores[home][v] = env[v].to(self.dev[home])

    def on_compute(self, i: int, s: Compute, op: Op) -> None:
        store, device = self.stores[s.device], self.dev[s.device]
        replay = is_random(op) and op.id in self.rng
        if replay:  # recomputation: draw the same numbers as the first run, then continue the stream as before
            kind, state = self.rng[op.id]
            if kind != device.type:
                raise XschedError(
                    f"random op first ran on a {kind} device; recomputing it on {device.type} cannot reproduce its "
                    "numbers",
                    stage="execute",
                    step=i,
                    op=op.id,
                    device=s.device,
                )
            resume = get_rng(device)
            set_rng(device, state)
        elif is_random(op):
            self.rng[op.id] = (device.type, get_rng(device))
        try:
            outs = run_op(op, store, device, self.graph)
        except XschedError as e:
            raise XschedError(e.detail, stage="execute", step=i, op=op.id, value=e.value, device=s.device) from e
        finally:
            if replay:
                set_rng(device, resume)
        for v, t in zip(op.outputs, outs):
            want = self.graph.value[v]
            if not isinstance(t, torch.Tensor) or t.numel() * t.element_size() != want.nbytes:
                got = t.numel() * t.element_size() if isinstance(t, torch.Tensor) else type(t).__name__
                raise at_step(wrong_size(op, v, got, want.nbytes, s.device), i, s)
            store[v] = t

    def on_copy(self, i: int, s: Copy) -> None:
        # a real copy even between two logical devices on one torch device, so no store aliases another
        self.stores[s.dst][s.value] = self.stores[s.src][s.value].to(self.dev[s.dst], copy=True)

    def on_free(self, i: int, s: Free) -> None:
        del self.stores[s.device][s.value]

    def after_step(self, i: int, s: Step) -> None:
        self.after.append(dict(self.used))

    def end(self) -> RunTrace:
        outputs = {v: self.stores[self.where_output(v)][v] for v in self.graph.outputs}
        recomputed = tuple(o for o, n in self.computed.items() if n > 1)
        return RunTrace(outputs, tuple(self.after), recomputed, dict(self.peak))


def execute(
    graph: Graph, plan: Plan, env: Mapping[str, torch.Tensor], devices: Mapping[str, torch.device | str] | None = None
) -> RunTrace:
    """Run `plan` with graph inputs from `env` (value id -> tensor); outputs and the residency trace.

    Memory is checked against `plan.budgets` in graph bytes (Value.nbytes), exactly as `simulate` counts it.
    """
    return ReferenceRun(graph, plan, env, devices).run()


def run_plan(
    graph: Graph, plan: Plan, env: Mapping[str, torch.Tensor], devices: Mapping[str, torch.device | str] | None = None
) -> dict[str, torch.Tensor]:
    """Run `plan` step by step; the graph outputs (value id -> tensor). See `execute` for the trace."""
    return execute(graph, plan, env, devices).outputs
