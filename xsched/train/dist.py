"""Data parallelism for `xsched train`: the process group torchrun describes (gloo for CPU tensors, NCCL for CUDA
ones where torch has it), DistributedDataParallel around the wrapped module, and the few collectives the loop needs.

Why DDP rather than an all-reduce of our own: xsched's wrapped module runs the plan inside a torch.autograd.Function
whose inputs are the trained parameters themselves, and its backward returns their gradients. Autograd therefore
accumulates each one into `param.grad` through the parameter's own AccumulateGrad node, the node DDP's reducer hooks,
so the reducer sees every gradient and averages it across ranks like any module's (tests/test_train_processes.py checks
the result against single-process eager PyTorch on the combined batch). DDP also broadcasts rank 0's parameters and
buffers at the start. The reducer cannot overlap communication with backward here, since the plan hands every
gradient over at once at its end; a hand-written all-reduce could do no better.
"""

from __future__ import annotations

import datetime
import gc
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from xsched.errors import XschedError

T = TypeVar("T")


@dataclass(frozen=True)
class World:
    """This process's place among the training processes (one of one without torchrun)."""

    rank: int = 0
    local_rank: int = 0
    size: int = 1
    backend: str | None = None  # None: no process group

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.backend is not None


def _env_int(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, default))
    except ValueError as e:
        raise XschedError(f"environment variable {name}={os.environ[name]!r} is not an integer", stage="train") from e


def local_rank() -> int:
    """This process's index on its machine (torchrun's LOCAL_RANK; 0 without torchrun)."""
    return _env_int("LOCAL_RANK", 0)


def join(use_cuda: bool) -> World:
    """Join the process group torchrun's environment describes (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT);
    a lone process (WORLD_SIZE unset or 1) joins none."""
    size = _env_int("WORLD_SIZE", 1)
    rank, local = _env_int("RANK", 0), _env_int("LOCAL_RANK", 0)
    if size <= 1:
        return World(rank, local, 1, None)
    if dist.is_initialized():  # a caller that set up its own group
        return World(dist.get_rank(), local, dist.get_world_size(), str(dist.get_backend()))
    backend = "cpu:gloo,cuda:nccl" if use_cuda and dist.is_nccl_available() else "gloo"
    if use_cuda:
        torch.cuda.set_device(local)
    dist.init_process_group(backend=backend, timeout=datetime.timedelta(minutes=30))
    return World(dist.get_rank(), local, dist.get_world_size(), backend)


def leave(world: World) -> None:
    """Destroy the process group. destroy_process_group only drops torch's own references to it; while DDP's
    reducer (kept alive by reference cycles) still held it, about 1 rank in 20 aborted at exit (std::terminate in
    gloo). Collecting the cycles first: none in 120 runs."""
    if world.distributed and dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()


def data_parallel(module: nn.Module, world: World) -> nn.Module:
    """`module` wrapped in DistributedDataParallel on a process group, else itself. The wrapped module's
    parameters all live on one device (their plan home), so DDP runs in its single-device mode without moving
    inputs: the loop puts them where the plan wants them."""
    if not world.distributed:
        return module
    return DistributedDataParallel(module, device_ids=None)


def mean(value: torch.Tensor, world: World) -> float:
    """The mean of a scalar over all ranks (the loss of the combined batch when every rank's batch is as large)."""
    if not world.distributed:
        return float(value.detach())
    t = value.detach().reshape(1).to(torch.float64).clone()
    dist.all_reduce(t)
    return float(t) / world.size


def gather(obj: T, world: World) -> list[T]:
    """Every rank's `obj`, in rank order, on every rank."""
    if not world.distributed:
        return [obj]
    out: list[Any] = [None] * world.size
    dist.all_gather_object(out, obj)
    return out


def broadcast(obj: T, world: World) -> T:
    """Rank 0's `obj` on every rank."""
    if not world.distributed:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def barrier(world: World) -> None:
    if world.distributed:
        dist.barrier()


def main_first(world: World, fn: Callable[[], T]) -> T:
    """`fn()` on rank 0, then on the other ranks (which then find what rank 0 cached). An XschedError on rank 0
    is raised on every rank, so they all stop with the same one-line message instead of waiting."""
    if not world.distributed:
        return fn()
    if world.main:
        try:
            out, failed = fn(), None
        except XschedError as e:
            broadcast(str(e), world)
            raise
        broadcast(failed, world)
        return out
    message = broadcast(None, world)
    if message is not None:
        raise XschedError(f"rank 0 failed: {message}", stage="train")
    return fn()
