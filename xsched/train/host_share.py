"""How the host optimizer's worker shares the host's cores with the threads that issue the plan (the training thread
and, beside a GPU, the executor's lanes): fewer intra-op threads than cores, so that no lane waits for a core held
by a fused AdamW thread (and no AdamW thread, which its parallel region waits for, is preempted by a lane), and a
lower priority (a raised nice value) for the worker and the threads it starts, its OpenMP team among them, so that
when they meet a lane ready to issue runs first. Measured on logical CPUs: `scripts/bench_host_share.py`."""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from xsched.errors import XschedError

HOST_NICE = 10  # Linux's CFS weighs a nice-10 thread 110 against a nice-0 lane's 1024: the lane runs first


@dataclass(frozen=True)
class HostShare:
    """The worker's share of the host: `threads` torch intra-op threads (None: torch's count, as any new thread
    gets), and `nice` added to its nice value (0: its priority as it is)."""

    threads: int | None = None
    nice: int = 0

    def __post_init__(self) -> None:
        if self.threads is not None and self.threads < 1:
            raise XschedError(f"the host optimizer needs at least one thread, got {self.threads}", stage="train")
        if self.nice < 0:
            raise XschedError(
                f"the host optimizer's nice increment must be at least 0 (a higher priority needs privileges), "
                f"got {self.nice}",
                stage="train",
            )


def available_cores() -> int:
    """The cores this process may run on (its affinity mask where the platform has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def default_share(issuing: int, beside_gpu: bool) -> HostShare:
    """The share beside a plan: next to a GPU, the cores the `issuing` threads leave (at most torch's thread count,
    at least one) at HOST_NICE, since there the lanes only issue work and a lane waiting for a core leaves the GPU
    idle; on logical CPUs as it is, since there the lanes compute on the same cores the optimizer would leave."""
    if not beside_gpu:
        return HostShare()
    return HostShare(max(1, min(torch.get_num_threads(), available_cores() - issuing)), HOST_NICE)


def take_share(share: HostShare) -> str:
    """Give the calling thread (the worker, before its first torch op) its share; what was done, in words. Its nice
    value is per thread on Linux, and threads it starts later inherit it; elsewhere it is left as it is. torch's
    thread count is the process's default for new threads too: `start_shared` restores that once this returns; this
    thread keeps its own, as torch reads it once per thread."""
    if share.threads is not None:
        torch.set_num_threads(share.threads)
    done = [f"{torch.get_num_threads()} thread(s)"]  # reading it fixes this thread's count (torch inits it once)
    if share.nice == 0:
        done.append("nice as it is")
    elif sys.platform.startswith("linux"):
        tid = threading.get_native_id()
        before = os.getpriority(os.PRIO_PROCESS, tid)
        os.setpriority(os.PRIO_PROCESS, tid, before + share.nice)
        done.append(f"nice {os.getpriority(os.PRIO_PROCESS, tid):+d}")
    else:
        done.append(f"nice as it is (a thread's own priority is Linux's; not on {sys.platform})")
    return ", ".join(done)


def start_shared(target: Callable[[], None], name: str, share: HostShare | None) -> tuple[threading.Thread, str]:
    """A started daemon thread that takes `share` (None: nothing), then runs `target`; returned once the share is
    taken, with what was done in words, torch's default thread count for new threads restored (the thread keeps its
    own). An error taking it is raised here, and `target` does not run."""
    threads = torch.get_num_threads()
    taken = threading.Event()
    got: list[str | BaseException] = []

    def run() -> None:
        try:
            got.append(take_share(share) if share is not None else "")
        except BaseException as e:  # raised in the starting thread
            got.append(e)
        finally:
            taken.set()
        if not isinstance(got[0], BaseException):
            target()

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    taken.wait()
    if share is not None and share.threads is not None:
        torch.set_num_threads(threads)  # the default back (this thread's own count is `threads` already)
    if isinstance(got[0], BaseException):
        raise XschedError(f"the host optimizer's worker could not take its share: {got[0]}", stage="train") from got[0]
    return thread, got[0]
