"""How `xsched train` turns gradients into an update, as torch's own pieces do it: autocast for bf16/fp16, loss
scaling for fp16 (torch.amp.GradScaler: a step with an inf or nan gradient is skipped and the scale lowered), the
learning-rate schedule, clipping by total norm (torch.nn.utils.clip_grad_norm_, after unscaling), and AdamW or SGD
with weight decay on the weights only (parameters of two or more dimensions; biases and norms are not decayed); with
the parameters on a home of their own (`--param-home`), AdamW there, overlapped with the run (HostUpdater): in bf16
the parameters are bf16 and the host keeps fp32 master weights; `--delayed-update` applies each update one step late
(xsched.train.host_adamw says exactly how)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from xsched.capture.autocast_rules import device_rules
from xsched.errors import XschedError
from xsched.train.config import TrainConfig
from xsched.train.host_adamw import HostAdamW, OverlapStats
from xsched.train.host_share import HostShare, default_share
from xsched.train.schedule import Schedule

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@contextlib.contextmanager
def autocast(precision: str, device_types: Iterable[str]) -> Iterator[None]:
    """torch.autocast to `precision` on each device type (cpu always: the model is captured on the CPU, so its
    casts are recorded there, by CUDA's rules where CPU autocast has rules CUDA's lacks when a GPU runs the graph:
    xsched.capture.autocast_rules); nothing for fp32."""
    with contextlib.ExitStack() as stack:
        if precision in DTYPES:
            for kind in sorted({"cpu", *device_types}):
                stack.enter_context(torch.autocast(kind, dtype=DTYPES[precision]))
            if "cuda" in device_types:
                stack.enter_context(device_rules("cuda"))
        yield


def default_weight_decay(optimizer: str) -> float:
    return 0.01 if optimizer == "adamw" else 0.0  # torch's AdamW default; SGD's is none


def param_groups(params: Iterable[nn.Parameter], weight_decay: float) -> list[dict[str, Any]]:
    """The trained parameters in two groups: weights (2+ dimensions) decayed, the rest (biases, norms) not."""
    trained = [p for p in params if p.requires_grad]
    groups = [
        {"params": [p for p in trained if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in trained if p.dim() < 2], "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]


class Updater:
    """The optimizer with its schedule, clipping and loss scaler: `backward(loss)` per micro-batch, `step(step)`
    per optimizer step; `state_dict()` is what a checkpoint keeps of them (the schedule's position is the step)."""

    def __init__(self, config: TrainConfig, params: Iterable[nn.Parameter], device_types: Iterable[str]) -> None:
        self.weight_decay = (
            config.weight_decay if config.weight_decay is not None else default_weight_decay(config.optimizer)
        )
        groups = param_groups(params, self.weight_decay)
        self.params = [p for g in groups for p in g["params"]]
        if config.optimizer == "sgd":
            self.opt: torch.optim.Optimizer = torch.optim.SGD(groups, lr=config.lr, momentum=0.9)
        else:
            self.opt = torch.optim.AdamW(groups, lr=config.lr)
        self.schedule = Schedule(config.lr_schedule, config.lr, config.warmup, config.min_lr, config.steps)
        self.clip = config.clip_grad
        kind = "cuda" if "cuda" in set(device_types) else "cpu"
        self.scaler = torch.amp.GradScaler(kind, enabled=config.precision == "fp16")

    def start(self, step: int) -> None:
        """An optimizer step begins: no gradients yet."""
        self.opt.zero_grad(set_to_none=True)

    def backward(self, loss: torch.Tensor, micro: int = 0, micro_batches: int = 1) -> None:
        """Micro-batch `micro` of `micro_batches`: gradients of the (scaled) loss, added to the step's."""
        self.scaler.scale(loss).backward()

    def step(self, step: int) -> tuple[float, float]:
        """Update with the gradients accumulated since zero_grad, at step `step`'s learning rate. Returns that rate
        and the gradients' total norm before clipping (inf or nan where fp16 overflowed: the update is skipped)."""
        lr = self.schedule.lr_at(step)
        for group in self.opt.param_groups:
            group["lr"] = lr
        self.scaler.unscale_(self.opt)
        norm = torch.nn.utils.clip_grad_norm_(self.params, self.clip if self.clip is not None else float("inf"))
        self.scaler.step(self.opt)
        self.scaler.update()
        return lr, float(norm)

    def settle(self) -> None:
        """Return once the parameters and the state are not being updated (this optimizer steps in `step`)."""

    def close(self) -> None:
        """Training is over."""

    @property
    def overlap(self) -> OverlapStats | None:
        """The host optimizer's time and the share of it hidden behind the backward (None: not overlapped)."""
        return None

    @property
    def loss_scale(self) -> float | None:
        return float(self.scaler.get_scale()) if self.scaler.is_enabled() else None

    def state_dict(self) -> dict[str, Any]:
        return {"optimizer": self.opt.state_dict(), "scaler": self.scaler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.opt.load_state_dict(state["optimizer"])
        if state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])


class HostUpdater(Updater):
    """AdamW where the parameters live (`--param-home`, the host), overlapped with the backward: the wrapped module
    hands each gradient to a HostAdamW as the plan releases it, each bucket's step runs as soon as its gradients
    are in, and the next step's reads of a parameter wait for its own bucket. The state dict is the plain
    Updater's (torch AdamW's over the parameters)."""

    def __init__(
        self,
        config: TrainConfig,
        wrapped: Any,
        device_types: Iterable[str],
        clock: Any = None,
        share: HostShare | None = None,
    ) -> None:
        super().__init__(config, wrapped.parameters(), device_types)
        named = dict(wrapped.module.named_parameters())
        self.names = {p: n for n, p in named.items()}
        decay = {self.names[p]: g["weight_decay"] for g in self.opt.param_groups for p in g["params"]}
        order = [(n, named[n]) for n in wrapped.release_order if n in decay]
        self.host = HostAdamW(
            order,
            decay,
            config.lr,
            delayed=config.delayed_update,
            clock=clock,
            read_order=wrapped.read_order,
            pin=wrapped.pins_host,  # its buffers are the weights' pinned home: the module pins only the rest
            share=share,
        )
        for n, p in order:  # .grad shows the step's gradient (autograd leaves it alone: the listener takes them)
            seg, off, k = self.host.of[n].slots[n]
            if seg.grad.dtype == p.dtype:  # a bf16 parameter's fp32 gradient is the host optimizer's alone
                p.grad = seg.grad[off : off + k].view(p.shape)
        self.wrapped = wrapped
        self.lr = config.lr
        wrapped.listen(self.host)

    def start(self, step: int) -> None:
        self.lr = self.schedule.lr_at(step)
        for group in self.opt.param_groups:
            group["lr"] = self.lr
        self.host.start_step()

    def backward(self, loss: torch.Tensor, micro: int = 0, micro_batches: int = 1) -> None:
        self.host.begin(first=micro == 0, last=micro == micro_batches - 1, lr=self.lr)
        loss.backward()
        self.host.end_backward()

    def step(self, step: int) -> tuple[float, float]:
        return self.lr, self.host.grad_norm()

    def settle(self) -> None:
        self.host.settle()

    def close(self) -> None:
        self.wrapped.listen(None)
        try:
            self.host.flush()  # a delayed update's last step reaches the parameters
        finally:
            self.host.close()

    @property
    def overlap(self) -> OverlapStats | None:
        return self.host.stats()

    def state_dict(self) -> dict[str, Any]:
        self.host.export_state(self.opt)
        try:
            return {**super().state_dict(), "host_master": self.host.master(self.names)}
        finally:
            self.opt.state.clear()  # the views stay with the returned dict only

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        raw = state["optimizer"]  # as saved: torch's load casts the moments to a bf16 parameter's dtype
        ids = [i for g in raw["param_groups"] for i in g["params"]]
        for i, p in zip(ids, [p for g in self.opt.param_groups for p in g["params"]]):
            if i in raw["state"]:
                self.opt.state[p] = dict(raw["state"][i])
        self.host.import_state(self.opt, self.names)
        self.host.load_master(self.names, state.get("host_master"))


def make_updater(
    config: TrainConfig,
    wrapped: Any,
    device_types: Iterable[str],
    world_size: int,
    clock: Any = None,
    issuing: int = 1,
) -> Updater:
    """The HostUpdater where the parameters have a home of their own and nothing needs every gradient before the
    first update (AdamW, no clipping, no fp16 loss scaling, one process); else the Updater, stepping after the
    backward where the parameters live. `issuing`: the threads that issue the plan's steps (the host optimizer
    leaves them their cores beside a GPU: `host_share`)."""
    blocker = host_optimizer_blocker(config, world_size)
    if blocker is None:
        return HostUpdater(config, wrapped, device_types, clock, host_share(config, issuing, wrapped.pins_host))
    if config.delayed_update:
        raise XschedError(f"--delayed-update needs the overlapped host optimizer, and {blocker}", stage="train")
    return Updater(config, wrapped.parameters(), device_types)


def host_share(config: TrainConfig, issuing: int, beside_gpu: bool) -> HostShare:
    """The host optimizer's threads and priority: `--host-threads` and `--host-nice` where given ("all": torch's
    count), else the default beside these `issuing` threads (train.host_share.default_share)."""
    default = default_share(issuing, beside_gpu)
    threads = config.host_threads if config.host_threads is not None else default.threads
    nice = config.host_nice if config.host_nice is not None else default.nice
    return HostShare(None if threads == "all" else threads, nice)  # type: ignore[arg-type]


def master_on_host(config: TrainConfig, world_size: int) -> bool:
    """bf16 with the parameters on a home of their own and the host optimizer: the module's weights are bf16 (the
    run computes, copies and sends gradients in bf16) and the host keeps their fp32 master weights."""
    return config.precision == "bf16" and host_optimizer_blocker(config, world_size) is None


def host_optimizer_blocker(config: TrainConfig, world_size: int) -> str | None:
    """Why --param-home cannot overlap the optimizer with the backward (None: it can)."""
    if config.param_home is None:
        return "no --param-home"
    if config.optimizer != "adamw":
        return f"--optimizer {config.optimizer} (the overlapped host optimizer is AdamW)"
    if config.clip_grad is not None:
        return "--clip-grad needs every gradient's norm before the first update"
    if config.precision == "fp16":
        return "fp16 loss scaling needs every gradient checked for overflow before the first update"
    if world_size > 1:
        return "under torchrun, DistributedDataParallel all-reduces the gradients after the backward"
    return None
