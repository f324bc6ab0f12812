"""The drop-in training module: `wrap(model, inputs, budgets)` captures, plans and runs a model through the executor.

Its forward runs the plan's steps before the autograd boundary inside a torch.autograd.Function and its
backward runs the rest, so `loss.backward()` and `optimizer.step()` work unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.autograd.function import _SingleLevelFunction
from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten

from xsched.capture.grad_outputs import GradOutputs
from xsched.capture.torch import capture
from xsched.contracts.graph import Graph
from xsched.contracts.plan import Compute, Copy, Plan
from xsched.contracts.profile import Profile
from xsched.errors import XschedError
from xsched.execute.compiled import getter
from xsched.execute.executor import Executor, RunState
from xsched.execute.param_home import ListenerSlot, ParamListener, ParamPoints, check_homes, param_homes
from xsched.execute.program import gather
from xsched.execute.reference import torch_device
from xsched.pipeline import plan_report, solve_plan


def _signature(inputs: tuple) -> tuple:
    return tuple(
        ("tensor", tuple(x.shape), x.dtype, x.requires_grad) if isinstance(x, torch.Tensor) else ("const", repr(x))
        for x in inputs
    )


def _output_spec(model: nn.Module, inputs: tuple) -> tuple[TreeSpec, list[Any], list[bool]]:
    """The structure of model(*inputs), found on fake tensors: its treespec, non-tensor leaves (None at tensors)
    and, for each tensor leaf, whether it has a gradient (floating point, requiring grad)."""
    with FakeTensorMode(allow_non_fake_inputs=False) as mode:
        state = {k: mode.from_tensor(t) for k, t in [*model.named_parameters(), *model.named_buffers()]}
        args = tuple(mode.from_tensor(x) if isinstance(x, torch.Tensor) else x for x in inputs)
        out = torch.func.functional_call(model, state, args)
    leaves, spec = tree_flatten(out)
    grads = [x.requires_grad and x.is_floating_point() for x in leaves if isinstance(x, torch.Tensor)]
    return spec, [None if isinstance(x, torch.Tensor) else x for x in leaves], grads


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
        return tree_unflatten([next(it) if x is None else x for x in self.leaves], self.spec)


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


class XschedModule(nn.Module):
    """A model run by xsched plans. Training calls (train mode, grad enabled) run the training plan through
    autograd; `torch.no_grad()` or `.eval()` runs an inference plan, captured and solved at first use.

    A call whose inputs differ in shape or dtype from every plan so far is re-captured and re-planned under
    the same budgets (each signature's plan is kept), unless the module was built from a given `plan`:
    then it raises XschedError, since that plan only fits the graph it was made for.

    profile: "measure" (default: the graph's costs measured on `devices` once, cached under `profile_dir`, default
    profiles/, as `xsched profile` stores them, and reused), "model" (modelled costs, no measurement) or a Profile.
    param_home: the device where the parameters and buffers live (their gradients end there too), e.g. the host
    beside a GPU; default the first device. `.plan` is the training plan of the example inputs; `.report()`
    describes it.

    stores: devices that hold values and run no op (e.g. the host beside a GPU): profiled for their copies only,
    planned with (values may be parked there and fetched back) and run as the memory they are. They need not be
    in `devices` or `budgets` (no budget: unbounded); graph inputs live on the first computing device.
    """

    def __init__(
        self,
        model: nn.Module,
        example_inputs: tuple,
        budgets: Mapping[str, str | int],
        devices: Sequence[str] | None = None,
        method: str = "auto",
        time_limit: float | None = None,
        profile: Profile | str = "measure",
        plan: Plan | None = None,
        inplace: bool = True,
        profile_dir: str | None = None,
        stores: Sequence[str] = (),
        param_home: str | None = None,
        compile: bool = False,
        grad_outputs: GradOutputs = "auto",
    ) -> None:
        super().__init__()
        self.grad_outputs = grad_outputs  # which outputs the training graphs differentiate (see `wrap`)
        self.compile = compile  # run one-device runs of steps as compiled regions (xsched.execute.segments)
        self.inplace = inplace  # Executor's in-place reuse of dying inputs (off: every op allocates, as captured)
        self.module = model
        self.budgets = dict(budgets)
        self.devices = list(devices) if devices is not None else (list(budgets) or (list(plan.devices) if plan else []))
        self.stores = list(dict.fromkeys(stores))
        if self.stores and plan is None:
            self.devices = _computing_first(self.devices, self.stores)
        self.method, self.time_limit, self.profile = method, time_limit, profile
        self.profile_dir = profile_dir
        self.fixed_plan = plan
        self.param_home = param_home
        if param_home is not None and param_home not in self.devices:
            raise XschedError(f"param_home {param_home!r} is not among the devices {self.devices}", stage="execute")
        self._slot = ListenerSlot()
        self.compiled: dict[tuple, Compiled] = {}
        inputs = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
        self._first = self._compile(("train", _signature(inputs)), inputs, inference=False, plan=plan)
        self._move_to_homes(self._first)

    @property
    def plan(self) -> Plan:
        """The training plan for the example inputs."""
        return self._first.plan

    @property
    def graph(self) -> Graph:
        """The captured training graph of the example inputs."""
        return self._first.graph

    def report(self) -> str:
        """How the plan was found, its predicted time and peaks against the budgets, its recomputes and copies."""
        return plan_report(self._first.graph, self._first.plan)

    def listen(self, listener: ParamListener | None) -> None:
        """Tell `listener` when each run is done with each parameter on its home, and make a run's reads of a
        parameter there wait for it (xsched.execute.param_home); None stops."""
        self._slot.listener = listener

    @property
    def release_order(self) -> tuple[str, ...]:
        """The parameter names in the order the training plan releases them (its backward makes their gradients)."""
        return self._first.points.order

    @property
    def read_order(self) -> tuple[str, ...]:
        """The same names in the order the training plan first reads them (a forward reads the first layers' first)."""
        return self._first.points.read_order

    def _move_to_homes(self, c: Compiled) -> None:
        """Params and buffers live on their plan home's torch device, so grads land where autograd expects them;
        on the host beside a GPU they are pinned, so the plan's copies to the GPU run asynchronously."""
        home_of = {
            c.graph.value[v].name: d for v, d in c.plan.homes.items() if c.graph.value[v].kind in ("param", "buffer")
        }
        pin = any(d.type == "cuda" for d in c.executor.dev.values()) and torch.cuda.is_available()
        with torch.no_grad():
            for name, t in [*self.module.named_parameters(), *self.module.named_buffers()]:
                dev = torch_device(home_of[name], c.executor.dev) if name in home_of else t.device
                if t.device != dev:
                    t.data = t.data.to(dev)
                if pin and dev.type == "cpu" and not t.is_pinned():
                    t.data = t.data.pin_memory()

    def _compile(self, key: tuple, inputs: tuple, *, inference: bool, plan: Plan | None = None) -> Compiled:
        name = type(self.module).__name__
        graph = capture(self.module, inputs, inference=inference, name=name, grad_outputs=self.grad_outputs)
        if plan is not None and plan.graph != graph.fingerprint and self.grad_outputs == "auto" and not inference:
            # a plan made for the graph of every output (capture's and `xsched capture`'s default) runs as made
            every = capture(self.module, inputs, name=name, grad_outputs="all")
            graph = every if every.fingerprint == plan.graph else graph
        homes = param_homes(graph, self.param_home) if self.param_home is not None else None
        if plan is None:
            how = (self.method, self.profile, self.time_limit, self.profile_dir, self.stores)
            plan = solve_plan(graph, self.budgets, self.devices or None, *how, homes=homes)
        elif self.param_home is not None:
            check_homes(graph, plan, self.param_home)
        spec, leaves, has_grad = _output_spec(self.module, inputs)
        c = self._bindings(graph, plan, inputs, spec, leaves)
        took = {
            int((graph.value[v].name or "").split(":")[1]) for v in graph.inputs if graph.value[v].kind == "tangent"
        }
        c.ungraded = () if inference else tuple(k for k, g in enumerate(has_grad) if g and k not in took)
        self.compiled[key] = c
        return c

    def _bindings(self, graph: Graph, plan: Plan, inputs: tuple, spec: TreeSpec, leaves: list[Any]) -> Compiled:
        """Resolve, once per graph, which module tensor or call input feeds each graph input and where each
        grad and buffer update goes. The module's parameter and buffer objects are taken as they are now
        (updating them in place, as optimizers and load_state_dict do, is seen; replacing them is not)."""
        params = dict(self.module.named_parameters())
        buffers = dict(self.module.named_buffers())
        updates = graph.buffer_updates or {}
        held, fed = [], []
        reread = _read_after_update(graph, plan)
        for vid in graph.inputs:
            v = graph.value[vid]
            if v.kind == "param":
                held.append((vid, params[v.name], False))
            elif v.kind == "buffer":
                held.append((vid, buffers[v.name], vid in reread))
            elif v.kind == "input":
                fed.append((vid, int((v.name or "").split(":")[1])))
        grads = graph.grads or {}
        input_grads = graph.input_grads or {}
        trained = [n for n, p in params.items() if p.requires_grad]
        tensors = [i for i, x in enumerate(inputs) if isinstance(x, torch.Tensor)]
        refs = [grads.get(n) for n in trained] + [input_grads.get(i) for i in tensors]
        watch = frozenset(r["ref"] for r in updates.values())
        points = ParamPoints(graph, plan, self._slot)
        ex = Executor(
            graph, plan, watch=watch, inplace=self.inplace, table={Copy: points.copy_kind}, compile=self.compile
        )
        points.bind(ex)
        return Compiled(
            graph,
            plan,
            ex,
            spec,
            leaves,
            [params[n] for n in trained],
            refs,
            held,
            fed,
            [(r, buffers[n]) for n, r in updates.items()],
            points,
        )

    def _get(self, mode: str, inputs: tuple) -> Compiled:
        key = (mode, _signature(inputs))
        if key in self.compiled:
            return self.compiled[key]
        if self.fixed_plan is not None:
            raise XschedError(
                f"inputs {_describe(inputs)} differ from those of the given plan's graph (or need an inference "
                f"plan, mode {mode!r}); wrap without plan= to re-plan per input shape",
                stage="execute",
            )
        return self._compile(key, inputs, inference=mode != "train")

    def use_plan(self, plan: Plan, example_inputs: Any) -> None:
        """Run this mode's calls (see `_mode`) with inputs like `example_inputs` by `plan`, made for the graph the
        mode captures (e.g. an inference plan `xsched train` cached), instead of solving one at their first call."""
        inputs = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
        mode = self._mode()
        self._compile((mode, _signature(inputs)), inputs, inference=mode != "train", plan=plan)

    def _mode(self) -> str:
        """train (train mode, grad enabled: the training plan through autograd), train-nograd or eval."""
        if self.training:
            return "train" if torch.is_grad_enabled() else "train-nograd"
        return "eval"

    def forward(self, *inputs: Any) -> Any:
        mode = self._mode()
        if mode == "train":
            c = self._get("train", inputs)
            run = _Run(c, inputs)
            apply = _PlanFunction.apply if torch._C._are_functorch_transforms_active() else _apply_c
            outs = apply(run, *c.params, *[x for x in inputs if isinstance(x, torch.Tensor)])
            return c.structure(outs)
        c = self._get(mode, inputs)
        run = _Run(c, inputs)
        outs = run.forward()
        if c.plan.boundary is not None:
            run.run(c.plan.boundary, None)
        assert run.state is not None
        c.points.end(run.state)
        return c.structure(outs)


def _read_after_update(graph: Graph, plan: Plan) -> set[str]:
    """Buffers some step reads after their update was first computed (recomputation of a batch norm): these
    need a per-call snapshot, since the update is written into the module buffer as soon as it exists."""
    of = {graph.value[v].updates: v for v in graph.outputs if graph.value[v].updates}
    updated: set[str] = set()
    out: set[str] = set()
    for s in plan.steps:
        if isinstance(s, Compute):
            op = graph.op[s.op]
            out.update(b for b in op.inputs if of.get(b) in updated)
            updated.update(op.outputs)
    return out


def _computing_first(devices: Sequence[str], stores: Sequence[str]) -> list[str]:
    """The computing devices, then the stores (added where `devices` lacks them): the solver homes graph inputs on
    the first device, which must run ops. A store that is the only device leaves nothing to compute on."""
    computing = [d for d in devices if d not in stores]
    if not computing:
        raise XschedError(
            f"no device left to compute on: devices {list(devices)} are all stores ({', '.join(stores)}); name a "
            "compute device in budgets or devices",
            stage="execute",
            device=stores[0],
        )
    return computing + list(stores)


def _describe(inputs: tuple) -> str:
    return ", ".join(
        f"{list(x.shape)}:{str(x.dtype).removeprefix('torch.')}" if isinstance(x, torch.Tensor) else repr(x)
        for x in inputs
    )


def wrap(
    model: nn.Module,
    example_inputs: Any,
    budgets: Mapping[str, str | int],
    devices: Sequence[str] | None = None,
    method: str = "auto",
    time_limit: float | None = None,
    profile: Profile | str = "measure",
    plan: Plan | None = None,
    inplace: bool = True,
    profile_dir: str | None = None,
    store: str | None = None,
    stores: Sequence[str] = (),
    param_home: str | None = None,
    compile: bool = False,
    grad_outputs: GradOutputs = "auto",
) -> XschedModule:
    """`model` as a module whose training steps run an xsched plan within `budgets` (see XschedModule): method
    "auto" by default, within `time_limit` seconds (default 60), on costs measured once and cached (`profile`).
    `store` (or several `stores`): a device that only holds values, e.g. `store="cpu"` beside `cuda:0`;
    `param_home`: where the parameters, buffers and gradients live (default the first device), e.g. that store;
    `compile`: each one-device run of computes and frees runs as one inductor-compiled region.
    `grad_outputs`: the outputs whose gradients the plan computes (xsched.capture.grad_outputs). "auto" (default):
    the scalar outputs when the forward returns any, as a model returning (logits, loss) is trained by
    `loss.backward()`, so no gradient of the logits is made or held; else every differentiable output. "all", or
    the positions among the forward's tensor outputs, when the loss reads others: a gradient reaching an output
    left out raises a one-line XschedError at that backward, which names the output."""
    if isinstance(stores, str):
        raise XschedError(f"stores must be a sequence of device names, got the string {stores!r}", stage="execute")
    both = (*([store] if store else []), *stores)
    return XschedModule(
        model,
        example_inputs,
        budgets,
        devices,
        method,
        time_limit,
        profile,
        plan,
        inplace,
        profile_dir,
        both,
        param_home,
        compile,
        grad_outputs,
    )
