"""The xsched rows of scripts/bench_gpu_memory.py: a plan run by the executor as it runs by default, interleaved with
eager PyTorch and the executor's other modes (the other overlap mode, the compute stream's copy pool, expandable
segments, planned addresses), each row beside the simulator's and the allocator model's predictions; the graph they
run, captured for the step measured."""

from __future__ import annotations

import functools
import statistics
from collections.abc import Callable, Mapping

import torch
from bench_gpu_torch_rows import SEED, grad_outputs, log, timed
from bench_offload import hidden_share
from gpu.memory_report import mib

from xsched.allocator import reserved_range, segment_size
from xsched.allocator.placement import ArenaPlan
from xsched.capture.torch import capture, unpack_outputs
from xsched.contracts.graph import Graph
from xsched.contracts.plan import Compute, Copy, Plan
from xsched.contracts.profile import Profile
from xsched.errors import CaptureError, XschedError
from xsched.execute.alloc_settings import use_expandable_segments
from xsched.execute.executor import Executor
from xsched.execute.live_bytes import measured_peaks
from xsched.simulate import simulate


def captured(model: torch.nn.Module, inputs: tuple, name: str, loss_backward: bool) -> Graph:
    """The graph of the step the torch rows run: every differentiable output with a ones tangent, or
    (`loss_backward`) the loss alone: "auto" differentiates the forward's scalar outputs, checked here to be the last
    output alone, a scalar: the loss the torch rows backpropagate."""
    graph = capture(model, inputs, name=name, grad_outputs=grad_outputs(loss_backward))
    tangents = [v for v in graph.inputs if graph.value[v].kind == "tangent"]
    names = [graph.value[v].name for v in tangents]
    last = f"tangent:{len(graph.forward_outputs or ()) - 1}"
    if loss_backward and (names != [last] or graph.value[tangents[0]].shape):
        raise CaptureError(
            f"--loss-backward: {name} differentiates {names}, not its last output alone as a scalar loss ({last})"
        )
    return graph


def log_row(row: dict) -> None:
    """An xsched row's line in the log: its time against eager, its peak and reserved memory beside the
    predicted, and the compute stream's copy pool where it was run."""
    log(
        f"{row['plan']}: {row['time_s'] * 1e3:.1f} ms ({row['time_s'] / row['eager_s']:.2f}x), peak "
        f"{mib(row['peak'])}, reserved {mib(row['reserved'])} (predicted {mib(row['predicted_reserved'])} to "
        f"{mib(row['predicted_reserved_ahead'])})"
        + (
            f"; copy_pool compute: {row['compute_pool_s'] * 1e3:.1f} ms, reserved "
            f"{mib(row['compute_pool_reserved'])} (predicted {mib(row['predicted_reserved_compute_pool'][0])} "
            f"to {mib(row['predicted_reserved_compute_pool'][1])})"
            if "compute_pool_s" in row
            else ""
        )
    )


def executors(graph: Graph, plan: Plan, a) -> dict[str, Executor]:
    """The executors a plan's row runs: as by default (`a.lanes`), the other mode when it copies (and the compute
    stream's copy pool on the lanes), and with expandable segments (`a.expandable_segments`), the setting left off
    after it was made (each run sets its own)."""
    exs = {"default": Executor(graph, plan, check=False, overlap=a.lanes)}
    if any(isinstance(s, Copy) for s in plan.steps):  # without copies a one-device plan runs alike in either mode
        exs["other"] = Executor(graph, plan, check=False, overlap=not a.lanes)
        if a.lanes:  # copies' destinations from the compute stream's pool: fewer reserved bytes, maybe later copies
            exs["compute_pool"] = Executor(graph, plan, check=False, overlap=True, copy_pool="compute")
    if a.expandable_segments:
        exs["expandable"] = ex = Executor(graph, plan, check=False, overlap=a.lanes, expandable_segments=True)
        use_expandable_segments(ex.dev.values(), on=False)  # the setting is the process's: on only while it runs
    if a.planned_addresses:  # its arena is allocated here, once: the runs' peaks above what is there exclude it
        exs["arena"] = Executor(graph, plan, check=False, overlap=a.lanes, planned_addresses="whole")  # whole steps
    return exs


def plan_row(
    label: str,
    graph: Graph,
    plan: Plan,
    profile: Profile,
    env: dict,
    compute: str,
    eager: Callable,
    a,
    want_grads: Mapping[str, torch.Tensor] | None = None,
):
    """The plan through the executor as it runs by default (`a.lanes`; CUDA: on its lanes, copies on side streams;
    logical CPUs: in plan order on the calling thread), interleaved with eager PyTorch (the row's "vs eager") and,
    when the plan copies, with the executor's other mode. Measured on the lanes, the step in plan order (copies on
    the compute stream) less the step on the lanes, over the plan's predicted copy time, is the share of copy time
    the lanes hide. The rows: the plan's, then (`a.expandable_segments`) the same plan with expandable segments.
    `want_grads`: eager PyTorch's gradients of the seeded step (bench_gpu_torch_rows.eager_grads); the row's
    `grad_err` is the largest relative error (norm-wise) of the plan's, from one more seeded run after the timed."""
    sim = simulate(graph, plan, profile, check_budgets=False)
    copy_s, predicted_hidden = hidden_share(graph, plan, profile)
    copies = sum(isinstance(s, Copy) for s in plan.steps)
    loss_id = graph.forward_outputs[-1]["ref"]  # zoo gpt2 returns (logits, loss)
    resident = sum(graph.value[v].nbytes for v in graph.inputs if plan.homes[v] == compute)
    exs = executors(graph, plan, a)
    counted: dict[str, int] = {}  # the executor's accounting of `compute`, less what is resident before a step

    def run(name: str) -> float:
        ex = exs[name]
        if ex.expandable_segments:  # its segments made with the setting on, every other run's with it off
            use_expandable_segments([ex.dev[compute]])
        try:
            st = ex.start(env)
            ex.run(st)
        finally:
            if ex.expandable_segments:
                use_expandable_segments([ex.dev[compute]], on=False)
        counted[name] = max(counted.get(name, 0), st.peak()[compute] - resident)
        return float(ex.outputs(st, [loss_id])[loss_id])

    # the caching-allocator model as the measured run allocates: the steps that overwrite a dying input (no
    # allocation there), copies written or read on side streams when on lanes (record_stream); growth above the
    # homed inputs, from the GPU keeping up with the host to the host a step ahead
    ex = exs["default"]
    low, high = reserved_range(graph, plan, profile, devices=[compute], reuse=ex.reuse, side_streams=ex.overlap)[
        compute
    ]
    pool_low, pool_high = reserved_range(
        graph, plan, profile, devices=[compute], reuse=ex.reuse, side_streams=True, copy_pool="compute"
    )[compute]
    grown = reserved_range(
        graph, plan, profile, devices=[compute], reuse=ex.reuse, side_streams=ex.overlap, expandable=True
    )[compute]
    # the executor's selection and offsets, with the profile's op workspaces counted outside the arena
    arena = ArenaPlan(graph, plan, handed=False, profile=profile).addresses if "arena" in exs else None
    arena_predicted = (
        reserved_range(graph, plan, profile, devices=[compute], reuse={}, side_streams=ex.overlap, arena=arena)[compute]
        if arena is not None
        else None
    )
    try:
        runs = {k: functools.partial(run, k) for k in exs}
        got = timed({**runs, "eager": eager}, exs["default"].dev[compute], a.iters, a.warmup)
        grad_err = grads_against(graph, exs["default"], env, want_grads) if want_grads else None
    finally:
        for ex in exs.values():
            ex.close()
    med = {k: statistics.median(v["times"]) for k, v in got.items()}
    mine = got["default"]
    row = {
        "plan": label,
        "time_s": med["default"],
        "eager_s": med["eager"],
        "eager_times": got["eager"]["times"],
        "peak": mine["peak"] if mine["peak"] is not None else measured_peaks(graph, plan, env)[compute],
        "counted_peak": counted["default"],
        "reserved": mine["reserved"],
        "predicted_reserved": low.step_reserved,
        "predicted_reserved_ahead": high.step_reserved,
        "loss": mine["loss"],
        "grad_err": grad_err,
        "predicted_s": sim.makespan_s,
        "predicted_seq_s": sim.time_s,
        "predicted_peak": sim.peak_bytes[compute] - resident,
        "copies": copies,
        "recomputes": sum(isinstance(s, Compute) for s in plan.steps) - len(graph.ops),
        "copy_s": copy_s,
        "hidden_predicted": predicted_hidden,
        "found_by": plan.solver.found_by,
        "budget": plan.budgets.get(compute),
    }
    if "compute_pool" in got:  # the same plan with copy_pool="compute", measured and predicted
        row["compute_pool_s"], row["compute_pool_reserved"] = med["compute_pool"], got["compute_pool"]["reserved"]
        row["predicted_reserved_compute_pool"] = (pool_low.step_reserved, pool_high.step_reserved)
    if copies:
        row["lanes_s"], row["inline_s"] = (med["default"], med["other"]) if a.lanes else (med["other"], med["default"])
        row["hidden"] = (row["inline_s"] - row["lanes_s"]) / copy_s if a.lanes and copy_s > 0 else None
    rows = [row]
    if "expandable" in got:
        rows.append(expandable_row(row, got["expandable"], counted["expandable"], grown))
    if "arena" in got:
        rows.append(arena_row(row, got["arena"], counted["arena"], arena, arena_predicted, compute))
    return rows


def grads_against(graph: Graph, ex: Executor, env: dict, want: Mapping[str, torch.Tensor]) -> float:
    """One more step of `ex`, seeded as the timed ones: the largest relative error (norm-wise: a GPU's reductions
    may sum in another order than eager's kernels) of its parameters' gradients against `want`, every one present."""
    torch.manual_seed(SEED)
    st = ex.start(env)
    ex.run(st)
    got = unpack_outputs(graph, ex.outputs(st, list(graph.outputs))).grads
    del st
    missing = sorted(set(want) - set(got))
    if missing:
        raise XschedError(f"the plan's step made no gradient of {missing[0]}", stage="bench")
    errs = [
        (got[n].detach().double().cpu() - w.double()).norm() / w.double().norm().clamp_min(1e-30)
        for n, w in want.items()
    ]
    return float(max(errs))


def expandable_row(row: dict, got: dict, counted: int, predicted: tuple) -> dict:
    """The plan's row again, measured with expandable segments (`got`: timed's entry of that run; `counted`: its
    executor's accounting) and predicted by the allocator model with them (the GPU keeping up, the host ahead)."""
    keep = ("eager_s", "predicted_s", "predicted_seq_s", "predicted_peak", "copies", "recomputes", "copy_s")
    out = {k: row[k] for k in (*keep, "hidden_predicted", "found_by", "budget") if k in row}
    out |= {
        "plan": f"{row['plan']}, expandable segments",
        "time_s": statistics.median(got["times"]),
        "loss": got["loss"],
    }
    out |= {"peak": got["peak"] if got["peak"] is not None else row["peak"], "counted_peak": counted}
    out |= {"reserved": got["reserved"], "eager_times": []}
    out |= {"predicted_reserved": predicted[0].step_reserved, "predicted_reserved_ahead": predicted[1].step_reserved}
    if row.get("copies"):
        out["hidden"] = None  # not measured for this run (its plan-order twin is not run)
    return out


def arena_row(row: dict, got: dict, counted: int, arena, predicted: tuple, compute: str) -> dict:
    """The plan's row again, run with planned addresses (Executor(planned_addresses="whole"): whole steps): on CUDA its measured peak
    and reserved growth above what was there before the run, plus the arena (allocated once, before: its bytes, and
    the segment cudaMalloc gave it); the allocator model's prediction with the arena (the GPU keeping up, the host
    ahead); the arena's bytes, their lower bound, and the most bytes the plan makes live outside it (op workspaces
    included), which with the arena are the predicted step peak."""
    out = expandable_row(row, got, counted, predicted)
    n = arena.arena_bytes.get(compute, 0)
    out["plan"] = f"{row['plan']}, planned addresses"
    if got["peak"] is not None:
        out["peak"] = got["peak"] + n
        out["reserved"] = got["reserved"] + segment_size(n) if n else got["reserved"]
    out |= {"arena": n, "arena_lower_bound": arena.lower_bound.get(compute, 0)}
    out["arena_outside_peak"] = arena.outside_peak.get(compute, 0)
    # the step's peak with the arena: all of it, allocated before, and the most outside it at once (workspaces too)
    out["predicted_peak"] = n + arena.outside_peak.get(compute, 0)
    return out
