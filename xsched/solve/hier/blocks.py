"""Each block's options, one solve per class of identical blocks, level by level in a pool of worker processes."""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from functools import partial
from multiprocessing import get_context
from typing import Any

from xsched.contracts.graph import Graph
from xsched.contracts.holds import all_pinned, holds_pinned
from xsched.contracts.profile import Profile
from xsched.errors import NoIncumbent
from xsched.solve.hier.canon import Canon, canon
from xsched.solve.hier.hierarchy import Block
from xsched.solve.hier.hilp import Unit
from xsched.solve.hier.leaf import LeafTask, leaf_options
from xsched.solve.hier.menu import Option, translate
from xsched.solve.hier.region import Region, late_grads, make_region, sub_profile
from xsched.solve.hier.upper import RegionTask, region_options
from xsched.solve.options import out_of_time


@dataclass
class BlockLog:
    """What solving the blocks did, counted as they are solved: classes of identical blocks, solves, and seconds on
    the bottom blocks and on the others (HierStats' fields of the same names)."""

    classes: int = 0
    solved: int = 0
    leaf_s: float = 0.0
    region_s: float = 0.0


class SolvedBlocks:
    """Each block's options, by its position in the hierarchy's walk; one solve per class of identical blocks."""

    def __init__(
        self,
        graph: Graph,
        profile: Profile,
        devices: tuple[str, ...],
        homes: Mapping[str, str],
        defer: Mapping[str, tuple[str, ...]],
    ) -> None:
        self.graph, self.profile, self.devices, self.homes = graph, profile, devices, homes
        self.defer = defer
        self.kept = frozenset(v for vs in defer.values() for v in vs)
        self.grads = late_grads(graph, defer)
        self.options: dict[int, list[Option]] = {}
        self.keys: dict[int, str] = {}
        self.log = BlockLog()

    def _region(self, b: Block) -> Region:
        name = f"{self.graph.name}[{b.f_ops[0] if b.f_ops else b.b_ops[0]}]"
        return make_region(self.graph, b.f_ops, b.b_ops, name, self.kept, self.grads)

    def _homes(self, region: Region) -> dict[str, str]:
        return {v: self.homes[v] for v in region.inputs if v in self.homes}

    def _classes(self, group: Sequence[Block], children: Callable[[Block], tuple[str, ...]]):
        members: dict[str, list[tuple[Block, Region, Canon]]] = {}
        for b in group:
            region = self._region(b)
            c = canon(region, self.profile, self.devices, self._homes(region), children(b))
            members.setdefault(c.key, []).append((b, region, c))
        self.log.classes += len(members)
        return members

    def _spread(self, members, results, pos: Mapping[int, int]) -> None:
        for (key, group), opts in zip(members.items(), results):
            rep = group[0][2]
            for b, _, c in group:
                ops, values = rep.to(c)
                i = pos[id(b)]
                self.keys[i] = key
                self.options[i] = (
                    opts if c is rep else [translate(o, ops, values, self.graph, self.profile) for o in opts]
                )

    def leaves(
        self,
        group: Sequence[Block],
        pos: Mapping[int, int],
        run,
        seconds: float,
        limit: int,
        seed: int,
        fractions: tuple[float, ...],
    ) -> None:
        t0 = time.perf_counter()
        members = self._classes(group, lambda b: ())
        tasks = [
            LeafTask(
                r,
                sub_profile(self.profile, r.graph),
                self.devices,
                self._homes(r),
                seconds,
                limit,
                seed,
                tuple(o for o in r.b_ops if o in self.defer),
                fractions,
            )
            for _, r, _ in (g[0] for g in members.values())
        ]
        results = run(leaf_options, tasks)
        self.log.solved += len(tasks)
        self._spread(members, results, pos)
        self.log.leaf_s += time.perf_counter() - t0

    def internal(
        self,
        group: Sequence[Block],
        pos: Mapping[int, int],
        run,
        seconds: float,
        limit: int,
        seed: int,
        node_limit: int | None = None,
    ) -> None:
        t0 = time.perf_counter()
        members = self._classes(group, lambda b: tuple(self.keys[pos[id(c)]] for c in b.children))
        tasks = []
        for b, r, _ in (g[0] for g in members.values()):
            units = tuple(Unit(c.f_ops, c.b_ops, tuple(self.options[pos[id(c)]])) for c in b.children)
            tasks.append(
                RegionTask(
                    r,
                    sub_profile(self.profile, r.graph),
                    units,
                    self.devices,
                    self._homes(r),
                    seconds,
                    limit,
                    seed,
                    tuple(o for o in r.b_ops if o in self.defer),
                    node_limit,
                )
            )
        results = run(region_options, tasks)
        self.log.solved += len(tasks)
        self._spread(members, results, pos)
        self.log.region_s += time.perf_counter() - t0


_logger = logging.getLogger(__name__)


def start_method() -> str:
    """fork (workers start at once), unless this process has initialised CUDA: a forked child inherits a CUDA
    context it cannot use and dies at its first CUDA call, or when its garbage collector frees a CUDA tensor."""
    torch = sys.modules.get("torch")  # not imported: no CUDA context (planning from files needs no torch)
    return "forkserver" if torch is not None and torch.cuda.is_initialized() else "fork"


class BlockPool:
    """map() over tasks: in this process for one worker or one task, else in a pool of worker processes (results
    in task order, so the outcome does not depend on which worker finishes first). A pool whose worker died
    (killed, out of memory) is given up, and its tasks run in this process: slower, but nothing is lost."""

    def __init__(self, workers: int | None, n: int) -> None:
        self.workers = max(1, workers if workers is not None else (os.cpu_count() or 1))
        self.executor: ProcessPoolExecutor | None = None

    def __enter__(self) -> Callable[[Callable, list], list]:
        return self.map

    def map(self, fn: Callable, tasks: list) -> list:
        """The tasks a worker-count at a time, the deadline checked between (a worker process cannot see it)."""
        out: list = []
        for k in range(0, len(tasks), self.workers):
            if k and out_of_time():
                raise NoIncumbent(f"hier: stopped at the time limit after {k} of {len(tasks)} blocks of a level")
            out += self._map(fn, tasks[k : k + self.workers])
        return out

    def _map(self, fn: Callable, tasks: list) -> list:
        if self.workers == 1 or len(tasks) <= 1:
            return [fn(t) for t in tasks]
        if self.executor is None:
            self.executor = ProcessPoolExecutor(self.workers, mp_context=get_context(start_method()))
        try:  # a worker does not see this process's context: it is told whether held outputs are pinned
            return list(self.executor.map(partial(_holding, all_pinned(), fn), tasks))
        except BrokenProcessPool as e:
            _logger.warning("hier: a worker process died (%s); solving the blocks in this process", e)
            self.workers = 1
            self.executor.shutdown(cancel_futures=True)
            self.executor = None
            return [fn(t) for t in tasks]

    def __exit__(self, *exc: object) -> None:
        if self.executor is not None:
            self.executor.shutdown(cancel_futures=True)


def _holding(pinned: bool, fn: Callable, task: Any) -> Any:
    """`fn(task)` in a worker process, with held outputs pinned as in the process that sent it (contracts.holds)."""
    with holds_pinned(pinned):
        return fn(task)
