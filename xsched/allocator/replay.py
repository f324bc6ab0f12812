"""A plan's allocations and frees replayed on the caching-allocator model (xsched.allocator.caching): reserved memory.

A GPU runs out on what the caching allocator reserves (its segments), not on the plan's peak (bytes of values).
`replay_reserved` walks a plan (xsched.interpret) and allocates as the executor does (xsched.execute.executor):
homed inputs first (and cuBLAS's workspace, see cublas_workspace), a compute's outputs then its workspace (scratch
the op allocates inside, freed when it returns: the profile measures it after a first call) on the compute stream, a copy
from the host on its copy lane's side stream, or on the compute stream with `copy_pool="compute"` (the executor's
option of the same name; steps._mover). With `expandable`, the executor's `expandable_segments` option: the setting
takes effect after the homed inputs (the model is on the GPU before the executor is made), for the step's
allocations. It is a model, checked by hand counts, not a measurement: blocks freed while other streams use them
(record_stream) are back in their pool by the next allocation if the GPU keeps up with the host, only after the step
if the host runs a step ahead (`host_ahead`): a run lies between the two.
"""

from __future__ import annotations

import os
import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass

from xsched.allocator.addresses import Addresses
from xsched.allocator.caching import CachingAllocator
from xsched.contracts.graph import Graph, Op
from xsched.contracts.plan import Compute, Copy, Free, Plan
from xsched.contracts.profile import Profile
from xsched.interpret import PlanInterpreter
from xsched.lanes import lane_of

# where the executor allocates a copy's destination on the GPU: "side", from the pool of the copy lane's side stream
# that writes it (the compute stream cannot reuse those blocks); "compute", from the compute stream's pool, the side
# stream waiting for every kernel queued on the compute stream before writing (which may delay prefetches)
COPY_POOLS = ("side", "compute")
DEFAULT_COPY_POOL = "side"


# aten operators that run on cuBLAS (or cuBLASLt, which shares its workspace by default)
CUBLAS_OPS = frozenset({"mm", "addmm", "bmm", "baddbmm", "addbmm", "mv", "addmv", "dot", "vdot", "_addmm_activation"})
KiB = 1024


def cublas_workspace(plan: Plan, graph: Graph, profile: Profile | None, device: str) -> int:
    """Bytes of cuBLAS's workspace on `device`'s compute stream: PyTorch allocates one per (cuBLAS handle, stream)
    through the caching allocator at the stream's first matmul and keeps it, so it is there before a step (the first
    run or a warm-up made it) in every mode alike (aten/src/ATen/cuda/CublasHandlePool.cpp). Its size is what
    CUBLAS_WORKSPACE_CONFIG asks (":SIZE:COUNT", KiB, summed), else 4096 KiB x 8 on compute capability 9.0 and
    4096 KiB x 2 + 16 KiB x 8 elsewhere. Counted only where the profile measured the device (its capability is
    known) and the plan runs a cuBLAS op there; 0 otherwise."""
    info = profile.devices.get(device) if profile is not None else None
    capability = (info.extra.get("fingerprint_parts") or {}).get("capability") if info is not None else None
    if capability is None or info.kind != "cuda":
        return 0
    targets = {
        tuple(graph.op[s.op].target.split(".")) for s in plan.steps if isinstance(s, Compute) and s.device == device
    }
    if not any(t[0] == "aten" and len(t) > 1 and t[1] in CUBLAS_OPS for t in targets):
        return 0
    asked = re.findall(r":(\d+):(\d+)", os.environ.get("CUBLAS_WORKSPACE_CONFIG", ""))
    if asked:
        return sum(int(size) * int(count) for size, count in asked) * KiB
    return 4096 * 8 * KiB if capability == "9.0" else (4096 * 2 + 16 * 8) * KiB


def op_workspace(op: Op, device: str, profile: Profile | None) -> int:
    """Scratch `op` allocates inside on `device` and frees before it returns: the graph's or the profile's, the larger."""
    cost = profile.op_cost(op.id, device) if profile is not None else None
    return max(op.workspace_bytes, cost.workspace_bytes if cost else 0)


@dataclass(frozen=True)
class ReservedPeak:
    """One device's modelled memory: the plan's peak (bytes of values, as the simulator counts them), the model's
    peaks of allocated (block sizes) and reserved (segments) bytes, and what was there before the first step (the
    homed inputs). `out_of_memory`: the first value whose segment did not fit the device's capacity (None: all did).
    `expandable`: with the expandable_segments setting on for the step."""

    plan_peak: int
    allocated: int
    reserved: int
    base_allocated: int
    base_reserved: int
    homed: int
    released: int = 0
    out_of_memory: str | None = None
    expandable: bool = False

    @property
    def fragmentation(self) -> int:
        """Reserved beyond the most ever allocated: rounding, unsplit tails, free pieces that fit no request."""
        return self.reserved - self.allocated

    @property
    def over_plan(self) -> float:
        """Reserved over the plan's peak, as a share of the peak."""
        return self.reserved / self.plan_peak - 1 if self.plan_peak else 0.0

    @property
    def step_reserved(self) -> int:
        """Reserved growth during the step (what max_memory_reserved less memory_reserved before measures)."""
        return self.reserved - self.base_reserved

    @property
    def step_peak(self) -> int:
        """The plan's peak above the homed inputs."""
        return self.plan_peak - self.homed

    def as_dict(self) -> dict:
        return {**vars(self), "fragmentation": self.fragmentation, "step_reserved": self.step_reserved}


def is_host(device: str, profile: Profile | None = None) -> bool:
    """Host memory: no CUDA caching allocator there (pinned host memory has its own, not modelled)."""
    info = profile.devices.get(device) if profile is not None else None
    return device.startswith("cpu") or (info is not None and info.kind == "cpu")


class _Replay(PlanInterpreter):
    """The plan's allocations and frees, in plan order, on one CachingAllocator per modelled device."""

    def __init__(
        self,
        graph: Graph,
        plan: Plan,
        profile: Profile | None,
        devices: Collection[str],
        capacity: Mapping[str, int],
        reuse: Mapping[int, str],
        side_streams: bool,
        host_ahead: bool,
        copy_pool: str = DEFAULT_COPY_POOL,
        expandable: bool = False,
        arena: Addresses | None = None,
    ) -> None:
        super().__init__(graph, plan)
        if copy_pool not in COPY_POOLS:
            raise ValueError(f"copy_pool must be one of {COPY_POOLS}, not {copy_pool!r}")
        self.copy_pool = copy_pool
        self.profile = profile
        self.reuse = reuse
        self.side_streams, self.host_ahead = side_streams, host_ahead
        self.models = {d: CachingAllocator(capacity.get(d)) for d in devices}
        self.donors: set[tuple[str, str]] = set()  # (value, device) whose block an in-place output took
        self.shared: set[tuple[str, str]] = set()  # (value, device) whose tensor a side stream used (record_stream)
        for v in graph.inputs:  # homed inputs are there before the step, allocated on the compute stream
            if (m := self.models.get(plan.homes[v])) is not None:
                m.alloc(v, self.nbytes[v])
        for d, m in self.models.items():  # and cuBLAS's workspace, kept since the first matmul
            if n := cublas_workspace(plan, graph, profile, d):
                m.alloc("cublas-workspace@", n)
        self.expandable = expandable
        for m in self.models.values():  # the setting, from the step's first allocation on
            m.expandable = expandable
        self.base = {d: (m.allocated, m.reserved) for d, m in self.models.items()}
        # planned addresses: one block for the arena, allocated once before the first step; its values allocate nothing
        self.placed = set(arena.offsets) if arena is not None else set()
        self.temporary = arena.temporary if arena is not None else {}
        self.in_arena: set[tuple[str, str]] = set()
        for d, n in (arena.arena_bytes if arena is not None else {}).items():
            if n and d in self.models:
                self.models[d].alloc("arena@", n)

    def workspace(self, i: int, s: Compute, op: Op) -> int:
        return op_workspace(op, s.device, self.profile)

    def on_compute(self, i: int, s: Compute, op: Op) -> None:
        m = self.models.get(s.device)
        if m is None:
            return
        donor, replaced = self.reuse.get(i), []
        for v in op.outputs:
            if (v, s.device, i) in self.placed:
                self.in_arena.add((v, s.device))
            elif donor is not None and donor in m.live:  # the op writes into its dying input's block (compile_inplace)
                m.live[v] = m.live.pop(donor)
                self.donors.add((donor, s.device))
            elif v in m.live:  # computed again while resident: the old tensor goes once the store holds the new
                replaced.append(v)
                m.alloc(f"{v}@new", self.nbytes[v])
            else:
                m.alloc(v, self.nbytes[v])
        # scratch inside the op, released before it returns (with the arena, a composite out='s temporaries too)
        m.alloc(f"workspace@{i}", self.workspace(i, s, op) + self.temporary.get(i, 0))
        m.free(f"workspace@{i}")
        for v in replaced:
            m.free(v)
            if f"{v}@new" in m.live:
                m.live[v] = m.live.pop(f"{v}@new")

    def on_copy(self, i: int, s: Copy) -> None:
        m = self.models.get(s.dst)
        if (s.value, s.dst, i) in self.placed:
            self.in_arena.add((s.value, s.dst))
        elif m is not None:
            # from the host on lanes: the copy lane's side stream's pool (copy_pool "side"), else the compute one
            side = self.side_streams and s.src not in self.models and self.copy_pool == "side"
            m.alloc(s.value, self.nbytes[s.value], lane_of(s) if side else "compute")
            if self.side_streams and (side or self.copy_pool == "compute"):
                # another stream uses it: the compute stream reads it (record_stream(reader)), or the side stream
                # writes it into a compute-stream block (record_stream(side))
                self.shared.add((s.value, s.dst))
        if self.side_streams and s.src in self.models:  # read on the copy lane's side stream: t.record_stream(side)
            self.shared.add((s.value, s.src))

    def on_free(self, i: int, s: Free) -> None:
        if (s.value, s.device) in self.in_arena:
            self.in_arena.discard((s.value, s.device))
            return
        m = self.models.get(s.device)
        shared = (s.value, s.device) in self.shared
        self.shared.discard((s.value, s.device))
        if m is not None and not self._donated(s.value, s.device):
            m.free(s.value, in_use_elsewhere=shared and self.host_ahead)

    def _donated(self, v: str, d: str) -> bool:
        if (v, d) in self.donors:
            self.donors.discard((v, d))  # its block lives on under the output; a later compute of v is new
            return True
        return False

    def end(self) -> dict[str, ReservedPeak]:
        out = {}
        for d, m in self.models.items():
            homed = sum(self.nbytes[v] for v, h in self.plan.homes.items() if h == d)
            oom = None if m.out_of_memory is None else str(m.out_of_memory)
            out[d] = ReservedPeak(
                self.peak[d], m.peak_allocated, m.peak_reserved, *self.base[d], homed, m.released, oom, self.expandable
            )
        return out


def replay_reserved(
    graph: Graph,
    plan: Plan,
    profile: Profile | None = None,
    *,
    devices: Collection[str] | None = None,
    capacity: Mapping[str, int] | None = None,
    reuse: Mapping[int, str] | None = None,
    side_streams: bool = True,
    host_ahead: bool = False,
    copy_pool: str = DEFAULT_COPY_POOL,
    expandable: bool = False,
    arena: Addresses | None = None,
) -> dict[str, ReservedPeak]:
    """Per modelled device (default: every plan device that is not the host): the plan's allocations and frees
    replayed on PyTorch's caching allocator rules. `capacity`: device bytes where cudaMalloc fails (default none);
    `reuse`: compute step -> the input it overwrites in place (the executor's `reuse`, when known); `side_streams`:
    copies run on their lane's side stream, as the executor on its lanes does, so the blocks they read or write are
    shared with it (record_stream; off: in plan order on the compute stream, nothing shared). The GPU's progress is unknown: by default blocks freed after use
    on another stream are back in their pool by the next allocation (the GPU keeps up); with `host_ahead` not until
    the step ends (the host runs a whole step ahead, as the executor's lanes may). A run lies between the two.
    `copy_pool`: the executor's option of that name (COPY_POOLS); `expandable`: its `expandable_segments` option;
    `arena`: its `planned_addresses` (xsched.execute.arena's addresses): the arena one block, its values none."""
    if devices is None:
        devices = [d for d in plan.devices if not is_host(d, profile)]
    replay = _Replay(
        graph,
        plan,
        profile,
        devices,
        capacity or {},
        reuse or {},
        side_streams,
        host_ahead,
        copy_pool,
        expandable,
        arena,
    )
    return replay.run()


def reserved_range(
    graph: Graph,
    plan: Plan,
    profile: Profile | None = None,
    *,
    devices: Collection[str] | None = None,
    reuse: Mapping[int, str] | None = None,
    side_streams: bool = True,
    copy_pool: str = DEFAULT_COPY_POOL,
    expandable: bool = False,
    arena: Addresses | None = None,
) -> dict[str, tuple[ReservedPeak, ReservedPeak]]:
    """Per modelled device: (the GPU keeping up, the host a step ahead), the two ends between which a run is
    expected; the same twice where no tensor is shared across streams. Arguments as replay_reserved's."""
    low, high = (
        replay_reserved(
            graph,
            plan,
            profile,
            devices=devices,
            reuse=reuse,
            side_streams=side_streams,
            host_ahead=ahead,
            copy_pool=copy_pool,
            expandable=expandable,
            arena=arena,
        )
        for ahead in (False, True)
    )
    return {d: (low[d], high[d]) for d in low}
