"""The drop-in training module: `wrap(model, inputs, budgets)` captures, plans and runs a model through the executor.

Its forward runs the plan's steps before the autograd boundary inside a torch.autograd.Function and its
backward runs the rest, so `loss.backward()` and `optimizer.step()` work unchanged."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import TreeSpec

from xsched.budgets import parse_budgets
from xsched.capture.grad_outputs import GradOutputs
from xsched.capture.torch import capture
from xsched.contracts.graph import Graph
from xsched.contracts.plan import Copy, Plan
from xsched.contracts.profile import Profile
from xsched.devices.spec import target_device_type
from xsched.errors import XschedError
from xsched.execute.back_to_back import stored_profile
from xsched.execute.compiled_memory import as_replanned
from xsched.execute.compiled_replans import MAX_REPLANS, CompiledReplans
from xsched.execute.executor import Executor
from xsched.execute.host_pin import move_to_homes, pin_unpinned, pins_host
from xsched.execute.param_home import ListenerSlot, ParamListener, ParamPoints, check_homes, param_homes
from xsched.execute.state_hooks import install_state_hooks
from xsched.execute.wrap_graph import computing_first, graph_to_run, read_after_update
from xsched.execute.wrap_run import Compiled, _apply_c, _PlanFunction, _Run
from xsched.execute.wrap_signature import GRADED_MODES, call_args, describe, output_spec, positional, signature
from xsched.pipeline import plan_report, solve_plan
from xsched.solve.reference import eager_peak


class XschedModule(CompiledReplans, nn.Module):
    """A model run by xsched plans. Calls with grad enabled run a training plan through autograd (in eval mode, one
    captured with eval's dropout and batch norm, as eager PyTorch differentiates them too); under `torch.no_grad()`
    an inference plan runs. Each is captured and solved at its first use.

    A call whose inputs differ in shape or dtype (or autocast) from every plan so far is re-captured and re-planned
    within the budgets (a percentage of its own eager peak, never less than the bytes it came to on the example
    inputs; each signature's plan is kept), unless the module was built from a given `plan`: then it raises
    XschedError, since that plan only fits the graph it was made for.

    profile: "measure" (default: the graph's costs measured on `devices` once, cached under `profile_dir`, default
    profiles/, as `xsched profile` stores them, and reused), "model" (modelled costs, no measurement) or a Profile.
    param_home: the device where the parameters and buffers live (their gradients end there too), e.g. the host
    beside a GPU; default the first device; `pins_host`: whether the host ones are pinned (beside a GPU, at the first
    run: xsched.execute.host_pin). `.plan` is the training plan of the example inputs; `.report()` describes it.

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
        hold_outputs: bool = True,
        expandable_segments: bool = False,
        chunk_loss: int | None = None,
        planned_addresses: bool = False,
        issue: str = "lanes",
    ) -> None:
        super().__init__()
        self.expandable_segments = expandable_segments  # the Executor's option: CUDA's expandable_segments on
        self.planned_addresses = planned_addresses  # the Executor's option: the step's values in one arena
        self.issue = issue  # the Executor's option: who issues an overlapped plan's steps (a thread per lane, or one)
        self.chunk_loss = chunk_loss  # the training graphs' cross-entropy in this many row blocks (see `wrap`)
        self.hold_outputs = hold_outputs  # the caller keeps the outputs through backward (see `wrap`)
        self.grad_outputs = grad_outputs  # which outputs the training graphs differentiate (see `wrap`)
        self.compile = compile  # run one-device runs of steps as compiled regions (xsched.execute.segments)
        self.inplace = inplace  # Executor's in-place reuse of dying inputs (off: every op allocates, as captured)
        self.module = model
        self.budgets = dict(budgets)
        self.devices = list(devices) if devices is not None else (list(budgets) or (list(plan.devices) if plan else []))
        self.stores = list(dict.fromkeys(stores))
        if self.stores and plan is None:
            self.devices = computing_first(self.devices, self.stores)
        self.device_type = target_device_type([*self.devices, *self.stores])  # whose kernels the graphs describe
        self.method, self.time_limit, self.profile = method, time_limit, profile
        self.profile_dir, self.fixed_plan = profile_dir, plan
        self.param_home = param_home
        if param_home is not None and param_home not in self.devices:
            raise XschedError(f"param_home {param_home!r} is not among the devices {self.devices}", stage="execute")
        self._slot = ListenerSlot()
        install_state_hooks(model, self._slot)  # saving and loading as of an eager model (xsched.execute.state_hooks)
        self.compiled: dict[tuple, Compiled] = {}
        inputs = call_args(model, example_inputs)
        self._first = self._compile(("train", signature(inputs)), inputs, inference=False, plan=plan)
        self._move_to_homes(self._first)

    def __deepcopy__(self, memo: dict) -> XschedModule:
        raise XschedError(
            "a wrapped module cannot be copied (its plans hold executors and their threads): copy the model before "
            "wrapping it (an EMA: copy.deepcopy(model)), and wrap the copy if it trains",
            stage="execute",
        )

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise XschedError(
            "a wrapped module cannot be pickled (torch.save of the module): save wrapped.module.state_dict() and "
            "wrap the model again after loading it",
            stage="execute",
        )

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
        parameter there wait for it (xsched.execute.param_home); None stops. A listener that packs the parameters
        into buffers of its own (train.host_adamw) must pin them where `pins_host` says, before the first run."""
        if self._pin_pending and listener is not None and not getattr(listener, "pinned", True):
            raise XschedError(
                "the listener's buffers are not pinned but this module pins its host parameters at its first run, "
                "which would part them from those buffers: build it with pin=module.pins_host",
                stage="execute",
            )
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
        """Params and buffers onto their plan homes (xsched.execute.host_pin); beside a GPU, the host ones are
        pinned at the first run, after an optimizer built before it has pinned the buffers it packs them into."""
        kinds = ("param", "buffer")
        home_of = {c.graph.value[v].name: d for v, d in c.plan.homes.items() if c.graph.value[v].kind in kinds}
        move_to_homes(self.module, home_of, c.executor.dev)
        self.pins_host = self._pin_pending = pins_host(c.executor.dev.values())

    def _compile(
        self,
        key: tuple,
        inputs: tuple,
        *,
        inference: bool,
        plan: Plan | None = None,
        limits: Mapping[str, int] | None = None,
        replans: int = 0,
        fallback: Compiled | None = None,
    ) -> Compiled:
        """Capture, plan (unless given) and bind; `limits`: a compiled re-plan's budgets, its plan solved within
        lower ones (`replan` of the plan it replaces), the `replans`-th for this key; `fallback`: the measured plan
        that fits, which a re-plan solved within more replaces until its own first run is measured."""
        traced = partial(capture, self.module, inputs, name=type(self.module).__name__, reuse_blocks=True)
        how_captured = (inference, self.grad_outputs, self.device_type, self.chunk_loss, self.hold_outputs)
        graph = graph_to_run(traced, plan, *how_captured)
        homes = param_homes(graph, self.param_home) if self.param_home is not None else None
        solved = plan is None
        if plan is None:
            budgets = self.compiled[key].replan if limits is not None else self._budgets_for(graph)
            how = (self.method, self._costs(graph, budgets), self.time_limit, self.profile_dir, self.stores)
            plan = solve_plan(graph, budgets, self.devices or None, *how, homes=homes, compile=self.compile)
            plan = as_replanned(plan, limits) if limits is not None else plan
        elif self.param_home is not None:
            check_homes(graph, plan, self.param_home)
        spec, leaves, has_grad = output_spec(self.module, inputs)
        c = self._bindings(graph, plan, inputs, spec, leaves)
        took = {
            int((graph.value[v].name or "").split(":")[1]) for v in graph.inputs if graph.value[v].kind == "tangent"
        }
        c.ungraded = () if inference else tuple(k for k, g in enumerate(has_grad) if g and k not in took)
        if self.compile and c.executor.segments is not None:
            c.limits = dict(plan.budgets)
            c.replans, c.fallback = replans, fallback
            c.first_run = self._measured if solved and (replans < MAX_REPLANS or fallback) else self._settled
        self.compiled[key] = c
        return c

    def _budgets_for(self, graph: Graph) -> Mapping[str, str | int]:
        """Bytes per device for a graph of another call: a percentage of its own eager peak, never less than what it
        came to on the example inputs (the device has that memory: an epoch's last, smaller batch, whose own peak
        is mostly the weights, fits where a share of it would not)."""
        if not self.compiled:  # the example inputs' graph itself
            return self.budgets
        first = parse_budgets(self.budgets, lambda: eager_peak(self._first.graph))
        own = parse_budgets(self.budgets, lambda: eager_peak(graph))
        return {d: max(b, first[d]) for d, b in own.items()}

    def _costs(self, graph: Graph, budgets: Mapping[str, str | int]) -> Profile | str:
        """The profile to plan with: "measure" is the stored one, else measured and calibrated back to back."""
        compute = [d for d in self.devices or list(budgets) if d not in self.stores]
        if self.profile != "measure" or not compute:  # no device: solve_plan says so
            return self.profile
        return stored_profile(graph, compute, self.profile_dir, self.stores)

    def _bindings(self, graph: Graph, plan: Plan, inputs: tuple, spec: TreeSpec, leaves: list[Any]) -> Compiled:
        """Resolve, once per graph, which module tensor or call input feeds each graph input and where each
        grad and buffer update goes. The module's parameter and buffer objects are taken as they are now
        (updating them in place, as optimizers and load_state_dict do, is seen; replacing them is not)."""
        params = dict(self.module.named_parameters())
        buffers = dict(self.module.named_buffers())
        updates = graph.buffer_updates or {}
        held, fed = [], []
        reread = read_after_update(graph, plan)
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
            graph,
            plan,
            watch=watch,
            inplace=self.inplace,
            table={Copy: points.copy_kind},
            compile=self.compile,
            expandable_segments=self.expandable_segments,
            planned_addresses=self.planned_addresses,
            issue=self.issue,
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
        key = (mode, signature(inputs))
        if key in self.compiled:
            c = self.compiled[key]
            if c.back_to is not None:
                return self._gone_back(key, c)
            return c if c.replan is None else self._replanned(key, c, inputs)
        if self.fixed_plan is not None:
            raise XschedError(
                f"inputs {describe(inputs)} differ from those of the given plan's graph (or need an inference "
                f"plan, mode {mode!r}); wrap without plan= to re-plan per input shape",
                stage="execute",
            )
        return self._compile(key, inputs, inference=mode not in GRADED_MODES)

    def use_plan(self, plan: Plan, example_inputs: Any) -> None:
        """Run this mode's calls (see `_mode`) with inputs like `example_inputs` by `plan`, made for the graph the
        mode captures (e.g. an inference plan `xsched train` cached), instead of solving one at their first call."""
        inputs = call_args(self.module, example_inputs)
        mode = self._mode()
        self._compile((mode, signature(inputs)), inputs, inference=mode not in GRADED_MODES, plan=plan)

    def _mode(self) -> str:
        """train (train mode, grad enabled: the training plan through autograd), train-nograd, eval-grad (eval mode
        with grad enabled: eval's dropout and batch norm, differentiated as eager PyTorch differentiates them) or
        eval."""
        if self.training:
            return "train" if torch.is_grad_enabled() else "train-nograd"
        return "eval-grad" if torch.is_grad_enabled() else "eval"

    def pin_host_memory(self) -> None:
        """Pin the host parameters and buffers not pinned yet, once, where `pins_host` (the first run does it)."""
        if self._pin_pending:
            pin_unpinned(self.module)
            self._pin_pending = False

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        inputs = positional(self.module, inputs, kwargs)
        self.pin_host_memory()
        mode = self._mode()
        if mode in GRADED_MODES:
            c = self._get(mode, inputs)
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
        c.ran()
        return c.structure(outs)


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
    hold_outputs: bool = True,
    expandable_segments: bool = False,
    chunk_loss: int | None = None,
    planned_addresses: bool = False,
    issue: str = "lanes",
) -> XschedModule:
    """`model` as a module whose training steps run an xsched plan within `budgets` (see XschedModule), traced on
    `example_inputs` (the forward's positional arguments as a tuple, one tensor, or a dict of keyword arguments;
    calls may pass keywords too): method
    "auto" by default, within `time_limit` seconds (default 60), on costs measured once and cached (`profile`).
    `store` (or several `stores`): a device that only holds values, e.g. `store="cpu"` beside `cuda:0`;
    `param_home`: where the parameters, buffers and gradients live (default the first device), e.g. that store;
    `compile`: each one-device run of computes and frees runs as one inductor-compiled region.
    `grad_outputs`: the outputs whose gradients the plan computes (xsched.capture.grad_outputs). "auto" (default):
    the scalar outputs when the forward returns any, as a model returning (logits, loss) is trained by
    `loss.backward()`, so no gradient of the logits is made or held; else every differentiable output. "all", or
    the positions among the forward's tensor outputs, when the loss reads others: a gradient reaching an output
    left out raises a one-line XschedError at that backward, which names the output.
    `hold_outputs`: the caller keeps the returned non-scalar outputs until its backward has run, as PyTorch code
    does (`logits = model(x); F.cross_entropy(logits, y).backward()`), so the plan counts them resident from the
    forward's end to the backward's, or, where their op has an `out=` form, may empty the caller's storage during
    the backward and refill it before it returns (xsched.execute.held); False where the caller drops them before `backward()` (the plan may then
    free and recompute them). `expandable_segments`, `planned_addresses`, `issue`: the Executor's options (CUDA's
    expandable segments before the plan's first allocation; the step's values in one arena; who issues the steps).
    `chunk_loss`: the training graph's cross-entropy (log_softmax + nll_loss, and its backward through the logits'
    matmul) computed in this many blocks of rows, so that no [tokens, vocab] tensor but the logits is made whole
    (xsched.capture.chunk_loss); a model without one is a one-line error."""
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
        hold_outputs,
        expandable_segments,
        chunk_loss,
        planned_addresses,
        issue,
    )
