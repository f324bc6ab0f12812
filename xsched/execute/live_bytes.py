"""An allocator-level count of live tensor bytes per logical device, independent of any plan's own accounting.

`LiveBytes` is a TorchDispatchMode: every storage an aten op returns that it has not seen is an allocation, of
the storage's real size, charged to the logical device named by `LiveBytes.device` (the step running); a
finalizer on the storage object charges its release back. Views and in-place results share a seen storage and
cost nothing, as in the allocator. What a kernel allocates and releases inside one call (C++ scratch) is not seen.
A storage resized in place (a held output emptied and refilled, `execute.held`) counts its new size when `resync`
runs: around each step of `counted_executor`, and when the mode exits.
`counted_executor` runs a plan through the executor with each step naming its device, so the count of a
`cpu:0` + `cpu:1` run on one CPU is split as the plan's devices are. Tests use it as the oracle of a plan's peak.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from xsched.contracts.graph import Graph
from xsched.contracts.plan import Compute, Copy, Free, Plan


class LiveBytes(TorchDispatchMode):
    """Live bytes per logical device while the mode is on: `used`, `peak`, and what `begin` marked as already
    there. `device` is where new storages count; set it before each step."""

    def __init__(self) -> None:
        super().__init__()
        self.device = "?"
        self.used: dict[str, int] = {}
        self.peak: dict[str, int] = {}
        self._seen: dict[int, list] = {}  # id(storage) -> [weakref to it, the device it counts on, its bytes]

    def track(self, t: torch.Tensor, device: str | None = None) -> None:
        """Count `t`'s storage on `device` (default the current one) unless it is counted already."""
        s = t.untyped_storage()
        key, n = id(s), s.nbytes()
        if key in self._seen or n == 0:
            return
        d = device or self.device
        self._seen[key] = [weakref.ref(s), d, n]
        self._charge(d, n)
        weakref.finalize(s, self._release, key)

    def resync(self) -> None:
        """Storages resized in place since they were counted (emptied, or given their bytes back, outside any op)
        count their size now, on the device where they were made."""
        for entry in self._seen.values():
            s = entry[0]()
            if s is not None and s.nbytes() != entry[2]:
                n = s.nbytes()
                self._charge(entry[1], n - entry[2])
                entry[2] = n

    def _charge(self, device: str, n: int) -> None:
        self.used[device] = self.used.get(device, 0) + n
        self.peak[device] = max(self.peak.get(device, 0), self.used[device])

    def _release(self, key: int) -> None:
        entry = self._seen.pop(key, None)
        if entry is not None:
            self.used[entry[1]] -= entry[2]

    def __exit__(self, *exc: Any) -> Any:
        self.resync()
        return super().__exit__(*exc)

    def reset_peak(self) -> None:
        self.peak = dict(self.used)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Mapping | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.track(t)
        return out


def _named(prepare: Callable, device_of: Callable[[Any], str], count: LiveBytes) -> Callable:
    def make(ex: Any, i: int, s: Any) -> Callable:
        fn, d = prepare(ex, i, s), device_of(s)

        def step(st: Any) -> None:
            count.resync()  # a storage emptied or refilled in place by a step not named here
            count.device = d
            fn(st)
            count.resync()  # or by this one

        return step

    return make


def counted_executor(graph: Graph, plan: Plan, count: LiveBytes, **kwargs: Any) -> Any:
    """An Executor for `plan` whose steps tell `count` their device (a compute's and a free's own, a copy's
    destination); it runs them in plan order on the calling thread, as on logical CPUs."""
    from xsched.execute.executor import Executor
    from xsched.execute.steps import prepare_compute, prepare_copy, prepare_free

    table = {
        Compute: _named(prepare_compute, lambda s: s.device, count),
        Copy: _named(prepare_copy, lambda s: s.dst, count),
        Free: _named(prepare_free, lambda s: s.device, count),
    }
    return Executor(graph, plan, table=table, overlap=False, **kwargs)


def measured_peaks(graph: Graph, plan: Plan, env: Mapping[str, torch.Tensor], **kwargs: Any) -> dict[str, int]:
    """Per plan device: the most live bytes counted during one run of `plan`, above the graph inputs homed there
    (what the simulator's peak less the homed inputs predicts)."""
    count = LiveBytes()
    ex = counted_executor(graph, plan, count, **kwargs)
    try:
        st = ex.start(env)
        with count:
            for store in st.stores.values():  # the homed inputs are there before the step: not counted
                for t in store.tensors.values():
                    count.track(t, "-")
            count.reset_peak()
            ex.run(st)
            return {d: count.peak.get(d, 0) for d in plan.devices}
    finally:
        ex.close()
