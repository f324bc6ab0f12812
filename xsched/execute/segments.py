"""Compiled segments: a one-device run of compute and free steps as one inductor-compiled region, its peak measured.

A region's computes become one torch.fx graph of the captured aten calls; inductor fuses it, so values the plan
makes and frees inside the region (fused intermediates) never materialise. What the plan keeps after the region
comes back as the graph's outputs, and what it frees is dropped from the store when the region ends, so the
residency after the region is the plan's. The bytes a fused region allocates are not the plan's per-op count
(a fused kernel holds its inputs while it writes its outputs): before its first call its generated code is read
(`compiled_code`), and a region that would go over its device's budget is split in two where its peak is
(`compiled_cuts`), each part checked so (a part of one compute runs uncompiled, as counted). Its first run is
measured through the allocator's events (torch.profiler, any device) and kept as the region's peak above what was
resident when it started; `compiled_walk.compiled_peaks` walks the plan with those figures in place of the per-op
counts of the region's steps.

Random ops the plan recomputes replay a saved generator state around their call, which a fused kernel cannot:
they run uncompiled between regions. Other random ops stay inside, drawing through ATen in graph order
(inductor's fallback_random), so their numbers are eager PyTorch's.
"""

from __future__ import annotations

import operator
import sys
from collections.abc import Callable, Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from xsched.budgets import format_bytes
from xsched.contracts.device_dtypes import adapted
from xsched.contracts.graph import Graph, Op
from xsched.contracts.plan import Compute, Free, Step
from xsched.contracts.random_ops import random_ops
from xsched.contracts.torch_ops import decode, resolve
from xsched.errors import XschedError
from xsched.execute.compiled import _has_ref, _rng_lock
from xsched.execute.compiled_code import CodePeak, code_peak_at
from xsched.execute.compiled_cuts import peak_cut
from xsched.execute.compiled_measure import measured_peak
from xsched.execute.steps import tagged
from xsched.interpret import wrong_size
from xsched.profiling.fused import REGION_LABEL

MIN_COMPUTES = 2  # a region of one op has nothing to fuse: it runs as a plain step


@dataclass(frozen=True)
class Region:
    """Plan steps (computes and frees on one device) run as one compiled call."""

    steps: tuple[int, ...]
    device: str
    inputs: tuple[str, ...]  # values read from the store, resident when the region starts
    outputs: tuple[str, ...]  # values the region leaves resident (computed in it, not freed after)
    drops: tuple[str, ...]  # values resident before the region that it frees
    watched: tuple[str, ...]  # watched values computed in it: their first tensors are returned too
    random: bool  # draws from an RNG: holds the device's generator lock while it runs

    @property
    def name(self) -> str:
        return f"steps {self.steps[0]}-{self.steps[-1]} on {self.device}"


def regions_of(
    graph: Graph,
    steps: Sequence[Step],
    idx: Sequence[int],
    eager_ops: frozenset[str],
    watch: frozenset[str],
    cuts: frozenset[int] | set[int] = frozenset(),
) -> list[Region | int]:
    """Steps `idx` (computes and frees on one device, run in this order) cut into regions and single steps that
    run uncompiled: computes of `eager_ops`, and regions of fewer than MIN_COMPUTES computes; a region also ends
    before each step of `cuts` (`Segments.split`)."""
    out: list[Region | int] = []
    piece: list[int] = []
    rnd = random_ops(graph)

    def flush() -> None:
        if sum(isinstance(steps[i], Compute) for i in piece) >= MIN_COMPUTES:
            out.append(_region(graph, steps, tuple(piece), watch, rnd))
        else:
            out.extend(piece)
        piece.clear()

    for i in idx:
        s = steps[i]
        if i in cuts:
            flush()
        if isinstance(s, Compute) and s.op in eager_ops:
            flush()
            out.append(i)
        else:
            piece.append(i)
    flush()
    return out


def _region(
    graph: Graph, steps: Sequence[Step], idx: tuple[int, ...], watch: frozenset[str], rnd: frozenset[str]
) -> Region:
    made: set[str] = set()  # computed in the region and still resident
    inputs: dict[str, None] = {}
    drops: dict[str, None] = {}
    watched: dict[str, None] = {}
    random = False
    for i in idx:
        s = steps[i]
        if isinstance(s, Compute):
            op = graph.op[s.op]
            random |= op.id in rnd
            for v in op.inputs:
                if v not in made and v not in drops:
                    inputs.setdefault(v)
            made.update(op.outputs)
            watched.update((v, None) for v in op.outputs if v in watch)
        elif isinstance(s, Free):
            if s.value in made:
                made.discard(s.value)
            else:
                drops.setdefault(s.value)
    outputs = tuple(v for v in _made_order(graph, steps, idx) if v in made)
    return Region(idx, steps[idx[0]].device, tuple(inputs), outputs, tuple(drops), tuple(watched), random)  # type: ignore[union-attr]


def _made_order(graph: Graph, steps: Sequence[Step], idx: Sequence[int]) -> list[str]:
    seen: dict[str, None] = {}
    for i in idx:
        s = steps[i]
        if isinstance(s, Compute):
            seen.update((v, None) for v in graph.op[s.op].outputs)
    return list(seen)


def region_graph(graph: Graph, steps: Sequence[Step], r: Region, device: torch.device) -> fx.GraphModule:
    """The region's computes as an fx graph: placeholders for its inputs, outputs (its kept values, then the
    first tensors of its watched values) as a tuple."""
    g = fx.Graph()
    env: dict[str, fx.Node] = {v: g.placeholder(f"in{k}") for k, v in enumerate(r.inputs)}
    first: dict[str, fx.Node] = {}
    for i in r.steps:
        s = steps[i]
        if not isinstance(s, Compute):
            continue
        op = graph.op[s.op]
        call = op.call or {}
        args = tuple(_fx_arg(g, env, a, device) for a in call.get("args", []))
        kwargs = {k: _fx_arg(g, env, v, device) for k, v in call.get("kwargs", {}).items()}
        node = g.call_function(adapted(graph, op, _target(op), device.type), args, kwargs)
        for v, path in zip(op.outputs, call["outs"]):
            out = node
            for k in path:
                out = g.call_function(operator.getitem, (out, k))
            env[v] = out
            if v in r.watched:
                first.setdefault(v, out)
    g.output(tuple([env[v] for v in r.outputs] + [first[v] for v in r.watched]))
    return fx.GraphModule(torch.nn.Module(), g)


def _target(op: Op) -> Callable[..., Any]:
    if op.target == "getitem":
        return operator.getitem
    fn = resolve(op.target)
    return getattr(fn, "functional", fn)  # a random op as its functional overload (resolve runs it in place)


def _fx_arg(g: fx.Graph, env: Mapping[str, fx.Node], x: Any, device: torch.device) -> Any:
    if not _has_ref(x):
        const = decode(x, {}, device)
        if isinstance(const, torch.Tensor):
            raise XschedError("a tensor constant in an op's call cannot go into a compiled graph", stage="execute")
        return const
    if isinstance(x, dict) and "ref" in x:
        node = env[x["ref"]]
        for target, args in x.get("view", ()):
            node = g.call_function(resolve(target), (node, *decode(list(args), {}, device)))
        return node
    if isinstance(x, list):
        return [_fx_arg(g, env, y, device) for y in x]
    raise XschedError(f"cannot decode argument {x!r}", stage="execute")


class Segments:
    """The executor's compiled regions: built, compiled (per input shapes) and measured on their first run.
    `ex` is the Executor (this module sits beside it, so it takes it untyped); `compile_fn(gm, inputs)` compiles
    one region (default inductor) into a boxed callable: it takes the list of inputs, may empty it, and returns
    the outputs."""

    def __init__(self, ex: Any, compile_fn: Callable[[fx.GraphModule, list[torch.Tensor]], Callable] | None = None):
        self.ex = ex
        self.compile_fn = compile_fn or _inductor
        self.peaks: dict[tuple[int, ...], int] = {}  # region steps -> its measured peak above its start
        self.failed: dict[tuple[int, ...], str] = {}  # region steps -> why it runs uncompiled
        self._fns: dict[tuple, Callable] = {}
        self._runs: dict[tuple[int, ...], list[Callable[[Any], None]]] = {}  # built lazily, again after a split
        self.eager_ops = frozenset(ex.recomputed_random)
        self.cuts: set[int] = set()  # steps a region ends before (split regions)
        self.split_rounds = 0  # rounds of splits made (compiled_memory.split_overruns)
        self.tried_parts = 0  # parts compiled to choose a cut (`_part_fits`), each one compile

    def uncompile(self, steps: tuple[int, ...], device: str, why: str) -> None:
        """Region `steps` runs uncompiled from now on (its steps one by one, allocating as the plan counts), with a
        one-line notice naming it and why."""
        self.failed[steps] = why
        self.peaks.pop(steps, None)
        print(f"xsched: region steps {steps[0]}-{steps[-1]} on {device} runs uncompiled ({why})", file=sys.stderr)

    def split(
        self,
        steps: tuple[int, ...],
        device: str,
        why: str,
        at: tuple[Region, CodePeak] | None = None,
        fits: Callable[[int], bool] | None = None,
    ) -> None:
        """Region `steps` runs as two from the next call on, cut before the compute that makes its peak
        (`compiled_cuts.peak_cut`: where its compiled code `at` says, the latest there whose part before `fits`;
        else where the plan's per-op count of it is highest), each part compiled and checked or measured on its
        first run (a part of one compute runs uncompiled), with a one-line notice naming it."""
        ex = self.ex
        io = (at[0].inputs, at[0].outputs + at[0].watched) if at else ((), ())
        cut = peak_cut(ex.graph, ex.plan.steps, ex.nbytes, steps, io, at[1] if at else None, fits)
        self.cuts.add(cut)
        self.peaks.pop(steps, None)
        self._runs.clear()  # every program is built again, its regions cut; unchanged regions keep their code
        print(
            f"xsched: region steps {steps[0]}-{steps[-1]} on {device} split before step {cut} ({why})", file=sys.stderr
        )

    def _part_fits(self, r: Region, args: list[torch.Tensor], start: int, cut: int) -> bool:
        """Whether the part of region `r` before step `cut`, called with its share of `args` with `start` bytes
        resident, keeps within its device's budget by its compiled code (kept for its run); a part of one compute
        runs as counted, and a part whose code cannot be compiled or read is measured when it runs: both fit."""
        ex = self.ex
        part = regions_of(ex.graph, ex.plan.steps, [i for i in r.steps if i < cut], frozenset(), ex.watch)[0]
        if not isinstance(part, Region):
            return True
        given = dict(zip(r.inputs, args))
        part_args = [given[v] for v in part.inputs]
        key = _key(part.steps, part_args)
        if key not in self._fns:
            try:
                self.tried_parts += 1
                gm = region_graph(ex.graph, ex.plan.steps, part, ex.dev[part.device])
                self._fns[key] = self.compile_fn(gm, list(part_args))
            except Exception:  # the compiler cannot handle it: that part would run uncompiled, as counted
                return True
        return self._overruns(part, self._fns[key], part_args, start) is None

    def program(self, idx: Sequence[int]) -> Callable[[Any], None]:
        """A step function running steps `idx` (computes and frees on one device, in order) as compiled regions."""
        key = tuple(idx)

        def program(st: Any) -> None:
            runs = self._runs.get(key)
            if runs is None:
                runs = self._runs[key] = self._built(key)
            for run in runs:
                run(st)

        return program

    def _built(self, key: tuple[int, ...]) -> list[Callable[[Any], None]]:
        ex = self.ex
        parts = regions_of(ex.graph, ex.plan.steps, key, self.eager_ops, ex.watch, self.cuts)
        return [self._runner(p) if isinstance(p, Region) else self._step(p) for p in parts]

    def _step(self, i: int) -> Callable[[Any], None]:
        return tagged(self.ex.fns[i], i, self.ex.plan.steps[i])

    def _runner(self, r: Region) -> Callable[[Any], None]:
        ex = self.ex
        dev = ex.dev[r.device]
        gm: fx.GraphModule | None = None
        lock = _rng_lock(dev) if r.random else None
        fallback = [self._step(i) for i in r.steps]
        n_out = len(r.outputs)
        label = f"{REGION_LABEL}{r.steps[0]}-{r.steps[-1]}"  # profiling.fused.region_times reads its time

        def run(st: Any) -> None:
            nonlocal gm
            if r.steps in self.failed:
                for f in fallback:
                    f(st)
                return
            store = st.stores[r.device]
            try:
                args = [store.tensors[v] for v in r.inputs]
            except KeyError as e:
                raise XschedError(
                    "input value is not available",
                    stage="execute",
                    value=str(e.args[0]),
                    device=r.device,
                    step=r.steps[0],
                ) from e
            key = _key(r.steps, args)
            fn = self._fns.get(key)
            if fn is None:
                try:
                    gm = gm or region_graph(ex.graph, ex.plan.steps, r, dev)
                    fn = self._fns[key] = self.compile_fn(gm, args)
                except Exception as e:  # the compiler cannot handle it: this region runs uncompiled
                    self.uncompile(r.steps, r.device, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
                    for f in fallback:
                        f(st)
                    return
            start = store.bytes
            if r.steps not in self.peaks and (over := self._overruns(r, fn, args, start)):
                fits = lambda cut: self._part_fits(r, args, start, cut)  # noqa: E731
                self.split(r.steps, r.device, over[0], (r, over[1]), fits)  # before it runs: its parts, checked so
                args.clear()  # the parts' inputs die where the parts free them
                for part in self._built(r.steps):
                    part(st)
                return
            for v in r.drops:  # the store lets go first: the compiled call frees them at their last use in it
                store.drop(v)
            with lock if lock is not None else nullcontext(), torch.profiler.record_function(label):
                if r.steps not in self.peaks:  # first run: measure what the fused region really allocates
                    dying = [a for v, a in zip(r.inputs, args) if v not in store.tensors]
                    outs, self.peaks[r.steps] = measured_peak(lambda: fn(args), dev, dying)
                else:
                    outs = fn(args)  # boxed: it empties `args`, so each input dies at its last use
            peak = start + self.peaks[r.steps]
            if peak > store.peak:
                store.peak = peak
            for v, t in zip(r.outputs, outs):
                if t.nbytes != ex.nbytes[v]:
                    op = ex.graph.op[ex.graph.producer[v]]
                    raise wrong_size(op, v, t.nbytes, ex.nbytes[v], r.device)
                store.put(v, t)
            for v, t in zip(r.watched, outs[n_out:]):
                st.first.setdefault(v, t)

        return run

    def _overruns(self, r: Region, fn: Callable, args: list[torch.Tensor], start: int) -> tuple[str, CodePeak] | None:
        """Why region `r`, compiled as `fn` and called with `args` with `start` bytes resident, would go over its
        device's budget, and where its peak is, by its generated code (`compiled_code.code_peak_at`); None when it
        fits, or is not known."""
        limit = self.ex.plan.budgets.get(r.device)
        source = getattr(fn, "source_code", None)
        if limit is None or not isinstance(source, str):
            return None
        drops = set(r.drops)
        at = code_peak_at(source, args, [v in drops for v in r.inputs])
        if at is None or start + at.bytes <= limit:
            return None
        return f"its compiled code peaks at {format_bytes(start + at.bytes)}, over {format_bytes(limit)}", at


def _key(steps: tuple[int, ...], args: Sequence[torch.Tensor]) -> tuple:
    """A region's compiled code is kept per its steps and its inputs' shapes, strides and dtypes."""
    return (steps, *((tuple(a.shape), a.stride(), a.dtype) for a in args))


# Inductor runs a region's kernels in the plan's order: its reorderings (for locality, and for its own estimate of
# the peak) moved recomputations of later layers to the region's start on gpt2 small (CPU), holding them alive
# through the region: 0.71 MiB over the per-op count in one backward region, 0.14 MiB with both off.
INDUCTOR_CONFIG = {"fallback_random": True, "reorder_for_locality": False, "reorder_for_peak_memory": False}


def _inductor(gm: fx.GraphModule, inputs: list[torch.Tensor]) -> Callable:
    """Inductor on the region's aten graph, called boxed (a list it empties, so the compiled code drops each
    input after its last use, as the plan's frees inside the region do); random ops draw through ATen in graph
    order (fallback_random), as eager PyTorch does."""
    from torch._dynamo.utils import GmWrapper
    from torch._inductor.compile_fx import compile_fx

    return compile_fx(GmWrapper(gm, tuple), inputs, config_patches=INDUCTOR_CONFIG)
