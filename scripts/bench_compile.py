"""xsched compiled plans beside torch.compile on zoo gpt2: step time and measured peak in one run.

    python scripts/bench_compile.py                      # CPU: gpt2 small, 2 threads
    python scripts/bench_compile.py --device cuda:0      # GPT-2 6 layers, batch 8, T 1024 on one GPU
    python scripts/bench_compile.py --fit --repeat 3     # memory only: does each first plan fit, compiled?

Rows: eager PyTorch; torch.compile (default partitioner); torch.compile with activation_memory_budget at each
fraction of --budgets; xsched compiled plans (wrap(..., compile=True)) with the same fraction of torch.compile's
measured peak as their budget (plus the params and inputs, which the plan counts and the peak column does not);
and the xsched compiled eager plan. wrap plans them on costs priced as compiled (fusible ops free), measures their
regions on the first step, and plans once more within less when that step went over the budget (its notices are
in the notes); the predicted peak is the settled plan's, from its regions' measured allocations. --fit skips the
timings: for each xsched plan (solved --repeat times), its first step's compiled peak against its budget, what wrap
did about it, and the settled plan's predicted peak beside the allocator's count (memory is deterministic: it needs
no quiet machine). Step = forward +
loss + backward. Times: the median and the best of interleaved steps, so ratios share the machine's load (on a
shared box the best step is the least blurred). Peak: the bytes a step allocates above what existed before it, from the CPU
allocator's events (torch.profiler, bench_executor.step_memory) on the CPU, from max_memory_allocated on CUDA.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import importlib.util
import io
import os
import platform
import statistics
import subprocess
import sys
import time
import types
from collections.abc import Callable
from pathlib import Path

import torch

from xsched import zoo
from xsched.contracts.plan import Compute, Plan
from xsched.errors import BudgetError, XschedError
from xsched.execute.compiled_memory import MAX_SPLITS
from xsched.execute.wrap import MAX_REPLANS, wrap
from xsched.pipeline import PER_OP_KEY

_spec = importlib.util.spec_from_file_location("bench_executor", Path(__file__).resolve().parent / "bench_executor.py")
bench = importlib.util.module_from_spec(_spec)  # type: ignore[arg-type]
sys.modules["bench_executor"] = bench
_spec.loader.exec_module(bench)  # type: ignore[union-attr]


def loss_of(out: object) -> torch.Tensor:
    return out[1] if isinstance(out, tuple) else out.float().square().mean()  # type: ignore[union-attr,index]


def _call(m: torch.nn.Module, inputs: tuple) -> object:
    return m(*inputs)


def compiled(m: torch.nn.Module, inputs: tuple, frac: float) -> Callable[[], torch.Tensor]:
    """torch.compile'd m, forward and backward partitioned under activation_memory_budget=frac (1.0: the default
    min-cut partitioner). Dynamo caches per code object, so each budget gets its own copy of `_call`'s code."""
    import torch._functorch.config as functorch_config

    code = _call.__code__.replace(co_name=f"_call_{frac}", co_qualname=f"_call_{frac}")
    fn = torch.compile(types.FunctionType(code, globals()))
    with functorch_config.patch(activation_memory_budget=frac, enable_autograd_cache=False):
        loss_of(fn(m, inputs)).backward()  # compiles forward and backward under this budget
    return lambda: loss_of(fn(m, inputs))


def step_peak(loss_fn: Callable[[], torch.Tensor], params: list[torch.Tensor], device: torch.device) -> int:
    """Bytes one forward + backward allocates above what existed before it."""
    if device.type != "cuda":
        return bench.step_memory(loss_fn, params).peak
    for p in params:
        p.grad = None
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    loss_fn().backward()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before


def timed(fns: dict[str, Callable[[], torch.Tensor]], iters: int, device: torch.device) -> dict[str, list[float]]:
    """Each row's step times, the rows interleaved step by step (so a burst of load falls on all of them)."""
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(iters):
        for k, f in fns.items():
            sync()
            t0 = time.perf_counter()
            f().backward()
            sync()
            times[k].append(time.perf_counter() - t0)
    return times


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu", help="cpu, or cuda:N")
    ap.add_argument("--scale", help="zoo gpt2 scale (default small on the CPU, full:n_layer=6 on CUDA)")
    ap.add_argument("--batch", type=int, help="batch (default the scale's; 8 on CUDA)")
    ap.add_argument("--budgets", default="0.5", help="fractions of torch.compile's measured peak, comma-separated")
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads on the CPU")
    ap.add_argument("--smoke", action="store_true", help="a tiny gpt2 and 2 steps: checks the script runs (tests)")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--time-limit", type=float, help="the solver's time limit per plan, seconds (20 CPU, 5 CUDA)")
    ap.add_argument(
        "--eager-plan",
        action=argparse.BooleanOptionalAction,
        help="also the xsched compiled eager plan (default on the CPU; off on CUDA, to fit 2.5 minutes)",
    )
    ap.add_argument(
        "--profile",
        default="measure",
        choices=("model", "measure"),
        help="the solver's costs before wrap prices them as compiled: measured per op (wrap's default, what a user "
        "gets), or the bandwidth model",
    )
    ap.add_argument("--fit", action="store_true", help="memory only: each xsched plan's first compiled peak, no timing")
    ap.add_argument("--repeat", type=int, default=1, help="with --fit: plans solved per budget (auto varies)")
    ap.add_argument("--out", type=Path, help="append the markdown table here")
    ap.add_argument("--save-plans", type=Path, help="with --fit: each try's first plan saved here (plan<k>.json)")
    ap.add_argument("--plans", type=Path, help="with --fit: run the plans --save-plans saved instead of solving")
    ap.add_argument(
        "--plan", type=Path, action="append", help="timed rows: a plan file run at each of --budgets, in order"
    )
    a = ap.parse_args(argv)
    device = torch.device(a.device)
    cuda = device.type == "cuda"
    a.time_limit = a.time_limit or (5.0 if cuda else 20.0)
    with_eager_plan = a.eager_plan if a.eager_plan is not None else not cuda
    if not cuda:
        torch.set_num_threads(a.threads)
    scale = a.scale or ("full:n_layer=6" if cuda else "tiny" if a.smoke else "small")
    z = zoo.build("gpt2", batch=a.batch or (8 if cuda else None), scale=scale)
    inputs = tuple(x.to(device) for x in z.inputs)
    base = z.model.to(device)
    plan_dev = a.device if cuda else "cpu"
    fracs = [float(f) for f in a.budgets.split(",") if f]
    t_start = time.perf_counter()
    load_start = os.getloadavg()
    models: dict[str, torch.nn.Module] = {}
    fwds: dict[str, Callable[[], torch.Tensor]] = {}
    notes: list[str] = []

    def add(label: str, m: torch.nn.Module, fn: Callable[[], torch.Tensor]) -> None:
        models[label], fwds[label] = m, fn

    m = copy.deepcopy(base)
    add("eager PyTorch", m, lambda m=m: loss_of(m(*inputs)))
    for frac in dict.fromkeys([1.0, *([] if a.fit else fracs)]):
        label = "torch.compile" if frac == 1.0 else f"torch.compile, activation_memory_budget={frac}"
        log(f"compiling {label}")
        m = copy.deepcopy(base)
        add(label, m, compiled(m, inputs, frac))
    params = lambda k: [*models[k].parameters()]  # noqa: E731
    ref = step_peak(fwds["torch.compile"], params("torch.compile"), device)
    before = sum(p.numel() * p.element_size() for p in base.parameters()) + sum(x.nbytes for x in inputs)
    predicted: dict[str, int] = {}

    def planned(
        budget: str | int, method: str, given: Path | None = None, save: Path | None = None
    ) -> tuple[torch.nn.Module, list[str], tuple[float, float]]:
        """wrap(compile=True) settled: steps until its plan is (the first measures the regions; one over the budget
        plans again within less, a re-plan far under it once more within more, each measured by its first step);
        wrap's notices of them; the seconds wrap took, and the steps until settled (compiles, splits, re-plans).
        `given`: a plan file run instead of solving one (--plans); `save`: where to save the first plan."""
        t0 = time.perf_counter()
        w = wrap(
            copy.deepcopy(base),
            inputs,
            {plan_dev: budget},
            method=method,
            time_limit=a.time_limit,
            profile=a.profile,
            compile=True,
            plan=Plan.load(given) if given else None,
        )
        t1 = time.perf_counter()
        if save:
            save.parent.mkdir(parents=True, exist_ok=True)
            w._first.plan.save(save)  # type: ignore[attr-defined]
        with contextlib.redirect_stderr(io.StringIO()) as err:
            for _ in range(2 + MAX_SPLITS + 2 * MAX_REPLANS):  # until settled: each first step after a change measures
                loss_of(w(*inputs)).backward()
                c = w._first  # type: ignore[attr-defined]
                if c.first_run is None and c.replan is None and c.back_to is None:
                    break
        said = [line for line in err.getvalue().splitlines() if line.startswith("xsched:")]
        return w, said, (t1 - t0, time.perf_counter() - t1)

    if a.fit:
        tries = iter(range(10**6))

        def fit(frac: float) -> list[str]:
            k = next(tries)
            given, save = (d / f"plan{k}.json" if d else None for d in (a.plans, a.save_plans))
            try:
                w, said, setup = planned(before + int(frac * ref), "auto", given, save)
            except (BudgetError, XschedError) as e:  # a budget below the bound, said as a row, not a traceback
                return [f"| {frac:.0%} | no plan: {str(e).splitlines()[0][:200]} | - | - | - | - | - | - | - |"]
            measured = before + step_peak(lambda: loss_of(w(*inputs)), [*w.parameters()], device)
            return [fit_row(w, said, measured, plan_dev, frac, setup)]

        return fit_table(a, fit, ref)
    for frac in [None, *fracs] if with_eager_plan else fracs:
        budget = "100%" if frac is None else before + int(frac * ref)
        label = "xsched compiled eager plan" if frac is None else f"xsched compiled, {frac:.0%} of torch.compile's peak"
        log(f"planning and compiling {label} (budget {budget})")
        try:
            given = dict(zip(fracs, a.plan or [])).get(frac) if frac is not None else None
            w, said, _ = planned(budget, "eager" if frac is None else "auto", given)
        except (BudgetError, XschedError) as e:
            notes.append(f"{label}: no plan ({str(e).splitlines()[0][:300]})")
            continue
        c = w._first  # type: ignore[attr-defined]
        recomputes = sum(isinstance(s, Compute) for s in c.plan.steps) - len(c.graph.ops)
        per_op = c.plan.extra[PER_OP_KEY][plan_dev] - before
        within = c.plan.extra.get("planned_within", {}).get(plan_dev)
        again = f", re-planned within {within - before:,} B" if within else ""
        notes.append(
            f"{label}: plan by {c.plan.solver.method}{again}, {recomputes} recomputes, per-op count {per_op:,} B, "
            f"budget {c.plan.budgets[plan_dev] - before:,} B (less params and inputs)"
        )
        notes += [f"{label}: {line}" for line in said]
        predicted[label] = c.plan.predicted.peak_bytes[plan_dev] - before
        add(label, w, lambda w=w: loss_of(w(*inputs)))
    log("measuring")
    for f in fwds.values():  # warm-up
        f().backward()
    peaks = {k: step_peak(f, params(k), device) for k, f in fwds.items()}
    steps = timed(fwds, a.iters, device)
    times = {k: statistics.median(v) for k, v in steps.items()}
    best = {k: min(v) for k, v in steps.items()}  # the least loaded step: the ratio a shared box blurs least
    tc, pc, bc = times["torch.compile"], peaks["torch.compile"], best["torch.compile"]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    where = (
        torch.cuda.get_device_name(device) if cuda else f"{platform.machine()} CPU, {torch.get_num_threads()} threads"
    )
    lines = [
        f"Command: `python scripts/bench_compile.py {' '.join(argv if argv is not None else sys.argv[1:])}`, commit "
        f"{commit}, {datetime.date.today()}, {where}, torch {torch.__version__}; gpt2 {scale}, inputs "
        f"{[tuple(x.shape) for x in inputs]}, {a.iters} interleaved steps (forward + loss + backward).",
        "",
        "| row | step time (median) | vs torch.compile | best step | vs torch.compile | measured peak "
        "| vs torch.compile | xsched predicted peak |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for k in fwds:
        pred = f"{predicted[k] / 2**20:.2f} MiB" if k in predicted else "-"
        lines.append(
            f"| {k} | {times[k] * 1e3:.1f} ms | {times[k] / tc:.3f}x | {best[k] * 1e3:.1f} ms | {best[k] / bc:.3f}x "
            f"| {peaks[k] / 2**20:.2f} MiB | {peaks[k] / pc:.0%} "
            f"| {pred} |"
        )
    load = f"{load_start[0]:.1f} at the start, {os.getloadavg()[0]:.1f} at the end"
    lines += ["", *[f"- {n}" for n in notes], f"- wall time of the run: {time.perf_counter() - t_start:.0f} s"]
    lines.append(f"- machine load (1-minute load average): {load}")
    publish(lines, a.out)
    return 0


def publish(lines: list[str], out: Path | None) -> None:
    """The table printed, and appended to `out` (--out) when given."""
    text = "\n".join(lines) + "\n"
    print(text)
    if out:
        with out.open("a") as f:
            f.write(text)


def fit_table(a: argparse.Namespace, fit: Callable[[float], list[str]], ref: int) -> int:
    """--fit: `fit(frac)` (one table row per plan solved at frac of torch.compile's peak) for each of --budgets,
    --repeat times."""
    lines = [
        f"Command: `python scripts/bench_compile.py {' '.join(sys.argv[1:])}`, torch.compile's measured peak "
        f"{ref:,} B. All bytes with the params and inputs (the plan counts them; the step's peak column adds them).",
        "",
        "| budget | per-op count | first compiled step | what wrap did | cuts (parts compiled to choose them) | setup: wrap + steps to settle "
        "| settled: predicted | measured | predicted - measured |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for frac in [float(f) for f in a.budgets.split(",") if f]:
        for k in range(a.repeat):
            log(f"planning at {frac:.0%} of torch.compile's peak, try {k + 1} of {a.repeat}")
            lines += fit(frac)
    publish(lines, a.out)
    return 0


def fit_row(
    w: torch.nn.Module, said: list[str], measured: int, plan_dev: str, frac: float, setup: tuple[float, float]
) -> str:
    """One --fit row: the plan's budget and per-op count, its first compiled step's peak (wrap's notice of it, or
    within the budget when there is none), the regions split and the cuts made, the seconds wrap and the steps
    until settled took (`setup`), the settled prediction beside `measured`."""
    c = w._first  # type: ignore[attr-defined]
    mib = lambda b: f"{b / 2**20:.3f} MiB"  # noqa: E731
    first = next((ln for ln in said if "the compiled plan peaked at" in ln), None)
    count = lambda what: sum(what in ln for ln in said)  # noqa: E731
    before = count("its compiled code peaks at")  # split before they ran, by their generated code
    did = f"{before} regions split before they ran"
    did += f", then {count('over the budget split')} rounds of splits ({count('split before step') - before} regions)"
    did += f", {count('planning again')} re-plans" if count("planning again") else ""
    did += f", {count('runs uncompiled')} regions uncompiled" if count("runs uncompiled") else ""
    at = first.split(" at cpu ")[1].split(" over ")[0] if first else "within it"
    budget, pred = c.plan.budgets[plan_dev], c.plan.predicted.peak_bytes[plan_dev]
    return (
        f"| {mib(budget)} ({frac:.0%}) | {mib(c.plan.extra[PER_OP_KEY][plan_dev])} | {at} | "
        f"{did} | {len(c.executor.segments.cuts)} ({getattr(c.executor.segments, 'tried_parts', 0)}) | {setup[0]:.0f} + {setup[1]:.0f} s | {mib(pred)} | {mib(measured)} | {pred - measured:+,} B "
        f"({(pred - measured) / measured:+.2%}) |"
    )


if __name__ == "__main__":
    sys.exit(main())
