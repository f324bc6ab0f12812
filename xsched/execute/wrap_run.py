"""One call of a wrapped module: the captured graph bound to its plan and executor (`Compiled`), its run split at
the autograd boundary (`_Run`), and the autograd Function that runs it (`_PlanFunction`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.autograd.function import _SingleLevelFunction
from torch.utils._pytree import TreeSpec, tree_unflatten

from xsched.contracts.graph import Graph
from xsched.contracts.plan import Compute, Plan
from xsched.errors import XschedError
from xsched.execute.compiled import getter
from xsched.execute.executor import Executor
from xsched.execute.param_home import ParamPoints
from xsched.execute.program import gather
from xsched.execute.steps import RunState
from xsched.execute.wrap_signature import TENSOR


@dataclass
class Compiled:
    """One captured graph with its plan and executor, for one input signature and mode, and every per-call lookup
    resolved once: a call only zips tensors into the executor's stores and reads results back out."""

    graph: Graph
    plan: Plan
    executor: Executor
    spec: TreeSpec
    leaves: list[Any]
    params: list[nn.Parameter]  # trained params, the plan function's autograd inputs (the tensor inputs follow)
    grad_refs: list[dict | None]  # for each autograd input (params, then tensor inputs): its grad's ref
    held: list[tuple[str, torch.Tensor, bool]]  # graph input id, param or buffer, snapshot it per call?
    fed: list[tuple[str, int]]  # graph input id, position among the call's inputs
    updates: list[tuple[dict, torch.Tensor]]  # ref of a buffer's new value, the module buffer it goes to
    points: ParamPoints  # when the run is done with each param on its home (a listener's updates wait for it)
    ungraded: tuple[int, ...] = ()  # outputs with a gradient in eager that the graph does not differentiate
    # compiled: called once, after the first whole run (its regions measured); the budgets its peak must meet; the
    # lowered budgets to plan again within at the next call, when that run went over them
    first_run: Callable[[Compiled], None] | None = None
    limits: Mapping[str, int] = dataclasses.field(default_factory=dict)
    replan: dict[str, int] | None = None
    replans: int = 0  # re-plans made for this key before this plan
    # a re-plan solved within more than one that fit: that plan (measured, settled), and, once this one overran,
    # the plan the next call goes back to
    fallback: Compiled | None = None
    back_to: Compiled | None = None

    def __post_init__(self) -> None:
        # Params and buffers go into the stores as they are: the executor runs under no_grad, so nothing it
        # computes from them records autograd history (a forward output that is one of them is detached).
        self.held_ids = tuple(v for v, _, snap in self.held if not snap)
        self.held_tensors = [t for _, t, snap in self.held if not snap]
        self.snapshots = [(v, t) for v, t, snap in self.held if snap]
        g, ex = self.graph, self.executor
        self.tangents = [
            (v, int((g.value[v].name or "").split(":")[1]), g.value[v].shape or (), getattr(torch, g.value[v].dtype))
            for v in g.inputs
            if g.value[v].kind == "tangent"
        ]
        self.zeros_on = {v: ex.dev[self.plan.homes.get(v, ex.names[0])] for v, *_ in self.tangents}
        self.out_get = [(r["ref"], {d: getter(r, ex.dev[d]) for d in ex.names}) for r in g.forward_outputs or ()]
        self.grad_ids = tuple(dict.fromkeys(r["ref"] for r in self.grad_refs if r is not None))
        ends = ex.must_end_on
        homes = {ends.get(v) for v in self.grad_ids}
        self.grads_home = homes.pop() if len(homes) == 1 and None not in homes else None  # all on one device?
        # store -> the grad of each autograd input (None where it has none), views applied, in one generated call
        self.grads_of = gather(
            self.grad_refs, [ex.dev[ends.get(r["ref"], ex.names[0])] if r else None for r in self.grad_refs]
        )
        first: dict[str, int] = {}  # value -> the step that first computes it (buffer updates are written then)
        for i, s in enumerate(self.plan.steps):
            if isinstance(s, Compute):
                for v in g.op[s.op].outputs:
                    first.setdefault(v, i)
        self.first_step = first
        self._writes: dict[tuple[int, int], tuple[list[torch.Tensor], list[Any]]] = {}
        self.single = self.spec.is_leaf()

    def ran(self) -> None:
        """A whole run is done: the first one calls `first_run`."""
        if self.first_run is not None:
            hook, self.first_run = self.first_run, None
            hook(self)

    def writes(self, start: int, stop: int) -> tuple[list[torch.Tensor], list[Any]]:
        """The buffer updates first computed in steps [start, stop): module buffers and getters of their values."""
        if (start, stop) not in self._writes:
            ex, steps = self.executor, self.plan.steps
            rows = [(buf, r) for r, buf in self.updates if start <= self.first_step.get(r["ref"], -1) < stop]
            self._writes[(start, stop)] = (
                [buf for buf, _ in rows],
                [getter(r, ex.dev[steps[self.first_step[r["ref"]]].device]) for _, r in rows],  # type: ignore[union-attr]
            )
        return self._writes[(start, stop)]

    def structure(self, outs: Sequence[torch.Tensor]) -> Any:
        if self.single:
            return outs[0]
        it = iter(outs)
        return tree_unflatten([next(it) if x is TENSOR else x for x in self.leaves], self.spec)


class _Run:
    """One call of the wrapped module: its executor run, split at the autograd boundary."""

    __slots__ = ("c", "state")

    def __init__(self, c: Compiled, inputs: tuple) -> None:
        self.c = c
        env = dict(zip(c.held_ids, c.held_tensors))
        for vid, t in c.snapshots:  # updated buffers read after the update: it is written back mid-run
            env[vid] = t.detach().clone()
        for vid, pos in c.fed:
            env[vid] = inputs[pos].detach()
        self.state: RunState | None = c.executor.start(env)
        c.points.begin(self.state)

    def run(self, start: int, stop: int | None) -> None:
        """Run steps [start, stop), then write each buffer update first computed there into the module, once (so
        a second call in the same iteration reads it, as in eager PyTorch), never from a recomputation."""
        assert self.state is not None
        c = self.c
        c.executor.run(self.state, start, stop)
        bufs, gets = c.writes(start, len(c.plan.steps) if stop is None else stop)
        if bufs:
            first = self.state.first
            with torch.no_grad():
                torch._foreach_copy_(bufs, [get(first) for get in gets])

    def forward(self) -> tuple[torch.Tensor, ...]:
        assert self.state is not None
        self.run(0, self.c.plan.boundary)
        stores = list(self.state.stores.items())
        outs = []
        for vid, get in self.c.out_get:
            t = next((get[d](s.tensors) for d, s in stores if vid in s.tensors), None)
            if t is None:
                raise XschedError(
                    "a forward output is not resident at the autograd boundary", stage="execute", value=vid
                )
            outs.append(t.detach() if t.requires_grad else t)
        return tuple(outs)

    def backward(self, grads: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
        assert self.state is not None, "backward through the wrapped module twice"
        c = self.c
        _check_graded(c, grads)
        tangents = {}
        for vid, k, shape, dtype in c.tangents:
            gr = grads[k]
            # contiguous, as captured (autograd may hand an expanded gradient that a folded view cannot reshape)
            tangents[vid] = (
                gr.contiguous() if gr is not None else torch.zeros(shape, dtype=dtype, device=c.zeros_on[vid])
            )
        c.executor.bind(self.state, tangents)
        self.run(c.plan.boundary or 0, None)
        st, self.state = self.state, None  # the stores of this run go when this returns
        c.points.end(st)
        grads = None
        if c.grads_home is not None:
            try:
                grads = c.grads_of(st.stores[c.grads_home].tensors)
            except KeyError:  # not where it must end: let outputs() find it, or say it is nowhere
                pass
        if grads is None:
            grads = c.grads_of(c.executor.outputs(st, c.grad_ids))
        c.ran()
        listener = c.points.slot.listener
        if listener is not None and listener.takes_grads:  # the listener has them: autograd leaves .grad alone
            grads[: len(c.params)] = [None] * len(c.params)
        return grads


def _check_graded(c: Compiled, grads: Sequence[torch.Tensor | None]) -> None:
    """An output the graph does not differentiate (see `wrap`'s grad_outputs) must not receive a gradient: this
    run's forward kept nothing for its backward, and running the forward again would draw other dropout masks and
    update the buffers twice, so the step cannot be eager's. Say so, and how to capture it."""
    for k in c.ungraded:
        gr = grads[k]
        if gr is not None:
            took = sorted(k for _, k, _, _ in c.tangents)
            raise XschedError(
                f"forward output {k} ({str(gr.dtype).removeprefix('torch.')} {list(gr.shape)}) received a gradient, "
                f"but the plan was made for the backward of output(s) {took} alone; wrap with grad_outputs='all' "
                "(or the positions of every output the loss reads)",
                stage="execute",
            )


class _PlanFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, run: _Run, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        ctx.run = run
        ctx.set_materialize_grads(False)  # None for an output the loss does not read: _check_graded tells them apart
        outs = run.forward()
        ctx.mark_non_differentiable(*[o for o in outs if not o.is_floating_point()])
        return outs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[Any, ...]:  # type: ignore[override]
        run, ctx.run = ctx.run, None
        if run is None:
            raise XschedError("backward through the wrapped module's graph a second time", stage="execute")
        return (None, *run.backward(grads))


# Function.apply's Python layer only unwraps functorch's dead wrappers, a generator step per parameter, before
# calling the C++ apply; outside functorch transforms the wrapper calls the C++ apply directly.
_apply_c = super(_SingleLevelFunction, _PlanFunction).apply
