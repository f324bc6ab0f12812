"""What a lane runs for each plan step: a run's state (`RunState`: the stores, the RNG log, pinned staging), and
the step kinds (executor, index, step) -> the function a lane calls, copies included (how a tensor moves between
logical CPUs and on CUDA's streams), and `prepare_steps`, which builds every step's function on the plan
interpreter's walk. `ex` is the Executor, taken untyped: this module sits beside it."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from xsched.contracts.plan import Compute, Copy, Free
from xsched.errors import PlanError, XschedError
from xsched.execute.compiled import RngLog, compile_inplace, compile_op, with_rng
from xsched.execute.host_pin import pin_host
from xsched.execute.stores import DeviceStore
from xsched.interpret import PlanInterpreter, at_step, wrong_size
from xsched.lanes import lane_of

StepFn = Callable[["RunState"], None]


def tagged(fn: StepFn, i: int, step: Any) -> StepFn:
    """`fn`, step `i` of the plan run on its own, its XschedErrors naming that step (at_step)."""

    def run(st: RunState) -> None:
        try:
            fn(st)
        except XschedError as e:
            raise at_step(e, i, step) from e

    return run


@dataclass
class RunState:
    """One run (one training iteration) of a plan: the stores, the RNG log, and what the trace recorded."""

    stores: dict[str, DeviceStore]
    rng: RngLog = field(default_factory=RngLog)
    keep: list[torch.Tensor] = field(default_factory=list)  # pinned staging buffers, alive while copies may read them
    resident_after: list[dict[str, int]] = field(default_factory=list)
    first: dict[str, torch.Tensor] = field(default_factory=dict)  # watched values as first computed
    # held outputs released on a device: the caller's tensor, emptied in place, and its storage's bytes
    released: dict[tuple[str, str], tuple[torch.Tensor, int]] = field(default_factory=dict)
    next_step: int = 0

    def resident(self) -> dict[str, int]:
        return {d: s.bytes for d, s in self.stores.items()}

    def peak(self) -> dict[str, int]:
        return {d: s.peak for d, s in self.stores.items()}


def prepare_compute(ex: Any, i: int, s: Compute) -> StepFn:
    op = ex.graph.op[s.op]
    dev = ex.dev[s.device]
    kernel = compile_inplace(op, dev) if i in ex.reuse else compile_op(op, dev, graph=ex.graph)
    replay = with_rng(op, kernel, dev, record=op.id in ex.recomputed_random) if op.id in ex.random else None
    sized = [(v, ex.nbytes[v], v in ex.watch) for v in op.outputs]
    d = s.device

    def compute(st: RunState) -> None:
        store = st.stores[d]
        outs = replay(store.tensors, st.rng) if replay is not None else kernel(store.tensors)
        for (v, n, watched), t in zip(sized, outs):
            if t.nbytes != n:
                raise wrong_size(op, v, t.nbytes, n, d)
            store.put(v, t)
            if watched:
                st.first.setdefault(v, t)

    return compute


def prepare_copy(ex: Any, i: int, s: Copy) -> StepFn:
    move = _mover(ex, s)
    v, src, dst = s.value, s.src, s.dst

    def copy(st: RunState) -> None:
        st.stores[dst].put(v, move(st.stores[src].tensors[v], st))

    return copy


def prepare_free(ex: Any, i: int, s: Free) -> StepFn:
    v, d = s.value, s.device

    def free(st: RunState) -> None:
        st.stores[d].drop(v)

    return free


STEP_KINDS: dict[type, Callable[[Any, int, Any], StepFn]] = {
    Compute: prepare_compute,
    Copy: prepare_copy,
    Free: prepare_free,
}


def prepare_steps(ex: Any, kinds: Mapping[type, Callable[[Any, int, Any], StepFn]], check: bool) -> list[StepFn]:
    """Each plan step's function, from the step kinds `kinds`. Checked: the plan interpreter's walk (every rule of
    the semantics) builds them; unchecked: the same functions in plan order, for callers that validated the plan
    already."""
    return _Prepare(ex, kinds).run() if check else _unchecked(ex, kinds)


class _Prepare(PlanInterpreter):
    """The executor's preparation as hooks on the plan interpreter: each valid step gets its function."""

    stage = "execute"

    def __init__(self, ex: Any, kinds: Mapping[type, Callable[[Any, int, Any], StepFn]]) -> None:
        super().__init__(ex.graph, ex.plan)
        self.ex, self.kinds = ex, kinds
        self.fns: list[StepFn] = []

    def on_compute(self, i: int, s: Compute, op: Any) -> None:
        self.fns.append(self.kinds[Compute](self.ex, i, s))

    def on_copy(self, i: int, s: Copy) -> None:
        self.fns.append(self.kinds[Copy](self.ex, i, s))

    def on_free(self, i: int, s: Free) -> None:
        self.fns.append(self.kinds[Free](self.ex, i, s))

    def end(self) -> list[StepFn]:
        return self.fns


def _unchecked(ex: Any, kinds: Mapping[type, Callable[[Any, int, Any], StepFn]]) -> list[StepFn]:
    fns = []
    for i, s in enumerate(ex.plan.steps):
        if type(s) not in kinds:
            raise PlanError(f"unknown step {s!r}", stage="execute", step=i)
        fns.append(kinds[type(s)](ex, i, s))
    return fns


def pinned(t: torch.Tensor, st: RunState) -> torch.Tensor:
    """A host tensor a non-blocking copy to a GPU can read: `t` if pinned, else a pinned copy of it that the run
    keeps (st.keep) while the copy may still read it."""
    if t.is_pinned():
        return t
    staged = pin_host(t)
    st.keep.append(staged)
    return staged


def _mover(ex: Any, s: Copy) -> Callable[[torch.Tensor, RunState], torch.Tensor]:
    """How one copy moves a tensor: a real clone between logical CPU devices; on CUDA, non-blocking copies
    on the lane's side stream through pinned host memory into a block of `ex.copy_pool`'s stream, with
    record_stream telling the caching allocator which other streams use each tensor, so a free never hands its
    memory out while a stream still reads or writes it."""
    src, dst = ex.dev[s.src], ex.dev[s.dst]
    if src.type != "cuda" and dst.type != "cuda":
        return lambda t, st: t.to(dst, copy=True)
    side = ex.lanes[lane_of(s)].stream
    if dst.type == "cuda":
        reader = ex.compute_stream(s.dst)
        in_compute_pool = ex.copy_pool == "compute"

        def h2d_or_d2d(t: torch.Tensor, st: RunState) -> torch.Tensor:
            if t.device.type == "cuda":
                t.record_stream(side)
            else:
                t = pinned(t, st)
            if not in_compute_pool:  # from the side stream's pool; the compute stream reads it
                out = t.to(dst, non_blocking=True)
                out.record_stream(reader)
                return out
            # from the compute stream's pool, so the compute stream reuses its block once freed. The block may
            # have held a tensor the compute stream's queued kernels still use: the side stream waits for them
            # before writing, and record_stream(side) keeps the block until the write is done
            with torch.cuda.stream(reader):
                out = torch.empty_like(t, device=dst)
            side.wait_stream(reader)
            out.copy_(t, non_blocking=True)
            out.record_stream(side)
            return out

        return h2d_or_d2d

    def d2h(t: torch.Tensor, st: RunState) -> torch.Tensor:
        t.record_stream(side)
        out = torch.empty_like(t, device="cpu", pin_memory=True)
        out.copy_(t, non_blocking=True)
        return out

    return d2h
