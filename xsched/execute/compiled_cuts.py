"""Where a compiled region over its device's budget is cut: before the compute that makes its peak.

A region's compiled code goes over the plan's per-op count where a fused kernel holds its inputs while it writes
its outputs; a cut there splits that kernel, and each part is checked again before it runs (`segments`). Its
generated code (`compiled_code.code_peak_at`) says which of the region's kept values its peak allocation is (the
compute that makes it is then known), else between which steps the peak falls: after the last reads of the inputs
it has let go of, before the computes of the values it has not yet allocated. Within that window the cut goes
before the compute where the plan's own per-op count of the region is highest (the compiled excess adds to what the
plan holds there); a region whose code cannot be read is cut so over all of it. Cutting at the peak, rather than
in the middle, takes one cut where halving took one per halving until the part with the peak fit.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from xsched.contracts.graph import Graph
from xsched.contracts.plan import Compute, Free, Step
from xsched.execute.compiled_code import CodePeak

# Cuts whose first part is compiled and read before one is chosen: each try costs a compile (the part's code, kept
# for its run when chosen); on gpt2 small (CPU) the part that fit was among the peak kernel's first reads.
MAX_TRIES = 4


def peak_cut(
    graph: Graph,
    steps: Sequence[Step],
    nbytes: Mapping[str, int],
    region: Sequence[int],
    io: tuple[Sequence[str], Sequence[str]] = ((), ()),
    at: CodePeak | None = None,
    fits: Callable[[int], bool] | None = None,
) -> int:
    """The step of `region` (plan step indices, at least two computes) to cut it before. Its candidates: the
    computes of the kernel that its compiled code (`at`, for the region's inputs and returned values `io`) peaks
    at, as far as its reads and the value it allocated there tell; else the compute with the highest per-op count
    in the window that `at` leaves (all of the region without `at`). With `fits` (whether the part before a cut
    would fit, by its own compiled code), the latest candidate whose part before fits, trying at most MAX_TRIES:
    the longest first part, so the fewest cuts; the earliest tried where none does. Never the region's first
    compute: each part keeps one."""
    computes = [i for i in region if isinstance(steps[i], Compute)]
    tries = [computes[k] for k in _candidates(graph, steps, nbytes, computes, region, io, at)][:MAX_TRIES]
    for cut in tries if fits is not None else ():
        if fits(cut):
            return cut
    return tries[-1] if fits is not None else tries[0]


def _candidates(
    graph: Graph,
    steps: Sequence[Step],
    nbytes: Mapping[str, int],
    computes: Sequence[int],
    region: Sequence[int],
    io: tuple[Sequence[str], Sequence[str]],
    at: CodePeak | None,
) -> list[int]:
    """Positions among `computes` to cut before, latest first (see `peak_cut`); never 0."""
    lo, hi = 0, len(computes) - 1
    if at is not None:
        inputs, outputs = io
        made = {v: k for k, i in enumerate(computes) for v in graph.op[steps[i].op].outputs}  # type: ignore[union-attr]
        reads = _reads(graph, steps, computes)
        lo = max([lo, *(reads[inputs[k]][-1] + 1 for k in at.inputs_gone if inputs[k] in reads)])
        hi = min([hi, *(made[v] for k, v in enumerate(outputs) if k not in at.outputs_made and v in made)])
        if lo > hi:  # inductor fused across the plan's order: the window says nothing
            lo, hi = 0, len(computes) - 1
        # the peak kernel's computes: the first read of each input it reads from the window on, the value it writes
        kernel = {next((k for k in reads.get(inputs[j], ()) if k >= lo), -1) for j in at.peak_reads}
        if at.peak_output is not None and outputs[at.peak_output] in made:
            kernel.add(made[outputs[at.peak_output]])
        kernel = {max(1, k) for k in kernel if lo <= k <= hi}
        if kernel:
            return sorted(kernel, reverse=True)
    counts = _per_op_counts(graph, steps, nbytes, region)
    return [max(1, max(range(lo, hi + 1), key=lambda k: (counts[k], -k)))]


def _per_op_counts(graph: Graph, steps: Sequence[Step], nbytes: Mapping[str, int], region: Sequence[int]) -> list[int]:
    """Per compute of `region`: the bytes the plan counts during it, relative to the region's start (what it made
    and kept so far, less what it freed, plus the compute's outputs)."""
    now, out = 0, []
    for i in region:
        s = steps[i]
        if isinstance(s, Compute):
            new = sum(nbytes[v] for v in graph.op[s.op].outputs)
            out.append(now + new)
            now += new
        elif isinstance(s, Free):
            now -= nbytes[s.value]
    return out


def _reads(graph: Graph, steps: Sequence[Step], computes: Sequence[int]) -> dict[str, list[int]]:
    """Value -> the positions (among `computes`, in order) of the computes reading it."""
    reads: dict[str, list[int]] = {}
    for k, i in enumerate(computes):
        for v in dict.fromkeys(graph.op[steps[i].op].inputs):  # type: ignore[union-attr]
            reads.setdefault(v, []).append(k)
    return reads
