"""The xsched compiled rows of the GPU memory benchmark (scripts/bench_gpu_memory.py): the model wrapped with
`compile=True` at the xsched rows' budgets, on the benchmark's one profile (wrap prices it as compiled), settled by
its first steps (the regions measured; regions over the budget split, then a step over it plans again), then timed
like the torch rows."""

from __future__ import annotations

import contextlib
import io
import statistics
import time
from collections.abc import Callable

import torch
from bench_cuda import one_line
from bench_executor import step_memory
from bench_gpu_torch_rows import backward_of, grad_outputs, log, ones_for, timed, torch_step
from gpu.memory_report import mib

from xsched.contracts.plan import Compute, Copy
from xsched.contracts.profile import Profile
from xsched.execute.compiled_memory import MAX_SPLITS
from xsched.execute.wrap import MAX_REPLANS, wrap
from xsched.pipeline import PER_OP_KEY


def compiled_plan_row(
    label: str,
    model: torch.nn.Module,
    inputs: tuple,
    budgets: dict,
    devices: list[str],
    stores: list[str],
    profile: Profile,
    eager: Callable[[], float],
    a,
) -> dict:
    """One compiled plan's row: step time (interleaved with eager PyTorch), the step peak (CUDA
    max_memory_allocated; the CPU allocator's events), the settled plan's predicted peak (its regions as measured),
    wrap's notices (a re-plan, regions run uncompiled)."""
    dev = torch.device("cuda", int(devices[0].split(":")[1])) if devices[0].startswith("cuda") else torch.device("cpu")
    # the outputs the benchmark's torch and xsched rows backpropagate: every one, or (--loss-backward) the loss alone
    go = grad_outputs(a.loss_backward)
    how = dict(time_limit=a.time_limit, profile=profile, stores=stores, compile=True, grad_outputs=go)
    w = wrap(model, inputs, budgets, devices, **how)
    ones = ones_for(model, inputs, a.loss_backward)
    step = torch_step(w, inputs, ones, contextlib.nullcontext, a.loss_backward)
    run = backward_of(step, model)
    with contextlib.redirect_stderr(io.StringIO()) as err:
        for _ in range(2 + MAX_SPLITS + 2 * MAX_REPLANS):  # until settled: each first step after a change measures
            run()
            c = w._first  # type: ignore[attr-defined]
            if c.first_run is None and c.replan is None and c.back_to is None:
                break
    got = timed({"row": run, "eager": eager}, dev, a.iters, a.warmup)
    peak = got["row"]["peak"] if dev.type == "cuda" else step_memory(step, model.parameters()).peak  # type: ignore[arg-type]
    model.zero_grad(set_to_none=True)
    c = w._first  # type: ignore[attr-defined]
    graph, plan, compute = c.graph, c.plan, devices[0]
    resident = sum(graph.value[v].nbytes for v in graph.inputs if plan.homes.get(v) == compute)
    row = {"plan": label, "time_s": statistics.median(got["row"]["times"]), "peak": peak, "loss": got["row"]["loss"]}
    row |= {"eager_s": statistics.median(got["eager"]["times"]), "eager_times": got["eager"]["times"]}
    row |= {"reserved": got["row"]["reserved"], "budget": plan.budgets.get(compute)}
    row |= {"predicted_peak": plan.predicted.peak_bytes[compute] - resident}  # type: ignore[union-attr]
    row |= {"per_op_peak": plan.extra.get(PER_OP_KEY, {}).get(compute, 0) - resident}
    row |= {"copies": sum(isinstance(s, Copy) for s in plan.steps), "found_by": plan.solver.found_by}
    row |= {"recomputes": sum(isinstance(s, Compute) for s in plan.steps) - len(graph.ops)}
    row |= {"replanned_within": plan.extra.get("planned_within", {}).get(compute)}
    row |= {"uncompiled_regions": len(c.executor.segments.failed)}
    row |= {"notices": [line for line in err.getvalue().splitlines() if line.startswith("xsched:")]}
    return row


def compiled_plan_rows(
    model: torch.nn.Module,
    inputs: tuple,
    profile: Profile,
    plans: dict[str, tuple],
    store: str,
    eager: Callable[[], float],
    a,
    t_start: float,
) -> list[dict]:
    """A compiled row per xsched row (label -> (budgets, devices)), labelled "xsched compiled ..."; a row is
    skipped when less than 1.5x the last one's time is left before --deadline, or before the first one less than
    its solve's time limit and a minute (inductor on GPT-2's regions: tens of seconds)."""
    rows: list[dict] = []
    took = a.time_limit + 60.0
    for k, (budgets, devices) in plans.items():
        label = k.replace("xsched ", "xsched compiled ", 1)
        left = a.deadline - (time.perf_counter() - t_start)
        if left < 1.5 * took:
            rows.append({"plan": label, "error": f"skipped: {left:.0f} s left of --deadline"})
            continue
        t0 = time.perf_counter()
        stores = [store] if store in devices else []
        try:
            row = compiled_plan_row(label, model, inputs, budgets, devices, stores, profile, eager, a)
        except Exception as e:  # no plan, or a compile that fails: the other rows go on
            rows.append({"plan": label, "error": f"error: {one_line(e)}"})
            continue
        finally:
            model.zero_grad(set_to_none=True)
        took = row["setup_s"] = time.perf_counter() - t0
        rows.append(row)
        log(f"{label}: {row['time_s'] * 1e3:.1f} ms ({row['time_s'] / row['eager_s']:.2f}x), peak {mib(row['peak'])}")
    return rows
