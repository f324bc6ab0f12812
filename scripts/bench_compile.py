"""xsched compiled plans beside torch.compile on zoo gpt2: step time and measured peak in one run.

    python scripts/bench_compile.py                      # CPU: gpt2 small, 2 threads
    python scripts/bench_compile.py --device cuda:0 --deadline 225 --no-settle --json compile.json --out compile.md
    python scripts/bench_compile.py --fit --repeat 3     # memory only: does each first plan fit, compiled?

Rows, the most informative first (`bench_compile_rows.row_order`): torch.compile (default partitioner); xsched
compiled plans (wrap(..., compile=True)) at torch.compile's measured peak, then at each fraction of --budgets of it
(plus the params and inputs, which the plan counts and the peak column does not), each followed by torch.compile with
activation_memory_budget at that fraction; the xsched compiled eager plan; eager PyTorch. wrap plans on costs priced
as compiled (fusible ops free), measures the regions on the first step, and plans once more within less when that
step went over the budget (its notices are in the notes); the predicted peak is the settled plan's, from its regions'
measured allocations. Each xsched row's notes say where its setup went (capture, profile, solves, inductor's region
compiles, the steps until settled). --deadline S: solves shorten, a row not expected to finish in what is left is
skipped ("skipped: N s left"); the table (--out) and the rows (--json) are written after every row, so a run killed
at its timeout keeps what it measured; the table is printed last. --fit skips the timings: for each xsched plan
(solved --repeat times), its first step's compiled peak against its budget, what wrap did about it, and the settled
plan's predicted peak beside the allocator's count (memory is deterministic: it needs no quiet machine).
Step = forward + loss + backward. Times: the median and the best of each row's steps, interleaved with
torch.compile's, so ratios share the machine's load (on a shared box the best step is the least blurred). Peak: the
bytes a step allocates above what existed before it, from the CPU allocator's events (torch.profiler,
bench_executor.step_memory) on the CPU, from max_memory_allocated on CUDA.
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
import subprocess
import sys
import time
import types
from collections.abc import Callable
from pathlib import Path

import torch
from torch._dynamo.utils import counters

from xsched import zoo
from xsched.capture.torch import capture
from xsched.contracts.plan import Plan
from xsched.contracts.profile import Profile
from xsched.devices import get_device
from xsched.errors import BudgetError, XschedError
from xsched.execute.back_to_back import profile_calibrated
from xsched.execute.compiled_memory import MAX_SPLITS
from xsched.execute.wrap import MAX_REPLANS, wrap
from xsched.execute.wrap_graph import held_by_caller

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_compile_fit import fit_row, fit_table  # noqa: E402
from bench_compile_phases import PhaseClock, xsched_notes  # noqa: E402
from bench_compile_rows import Deadline, DeadlineReached, label_of, measured, row_order, table, write  # noqa: E402

_spec = importlib.util.spec_from_file_location("bench_executor", Path(__file__).resolve().parent / "bench_executor.py")
bench = importlib.util.module_from_spec(_spec)  # type: ignore[arg-type]
sys.modules["bench_executor"] = bench
_spec.loader.exec_module(bench)  # type: ignore[union-attr]


def loss_of(out: object) -> torch.Tensor:
    return out[1] if isinstance(out, tuple) else out.float().square().mean()  # type: ignore[union-attr,index]


def _call(m: torch.nn.Module, inputs: tuple) -> object:
    return m(*inputs)


def compiled(m: torch.nn.Module, inputs: tuple, frac: float, backend: str = "inductor") -> Callable[[], torch.Tensor]:
    """torch.compile'd m, forward and backward partitioned under activation_memory_budget=frac (1.0: the default
    min-cut partitioner). Dynamo caches per code object, so each budget gets its own copy of `_call`'s code."""
    import torch._functorch.config as functorch_config

    code = _call.__code__.replace(co_name=f"_call_{frac}", co_qualname=f"_call_{frac}")
    fn = torch.compile(types.FunctionType(code, globals()), backend=backend)
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


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu", help="cpu, or cuda:N")
    ap.add_argument("--scale", help="zoo gpt2 scale (default small on the CPU, full:n_layer=6 on CUDA)")
    ap.add_argument("--batch", type=int, help="batch (default the scale's; 8 on CUDA)")
    ap.add_argument("--budgets", default="0.5", help="fractions of torch.compile's measured peak, comma-separated")
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads on the CPU")
    ap.add_argument("--smoke", action="store_true", help="a tiny gpt2 (tests)")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--time-limit", type=float, help="the solver's time limit per plan, seconds (20 CPU, 5 CUDA)")
    ap.add_argument(
        "--deadline",
        type=float,
        help="seconds for the whole run: solves shorten (to a tenth of what is left), a row not expected to finish "
        "is skipped",
    )
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
    ap.add_argument(
        "--profile-s",
        type=float,
        help="with --profile measure: the xsched rows' one profile measured here within this many seconds "
        "(default: wrap's own, uncapped and cached in profiles/; a tenth of --deadline under one)",
    )
    ap.add_argument(
        "--settle",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="a compiled re-plan far under its budget is solved once more within more, as wrap does (default); "
        "--no-settle keeps it: a solve and its regions' compiles fewer",
    )
    ap.add_argument("--compile-backend", default="inductor", help="torch.compile's backend for its rows")
    ap.add_argument("--fit", action="store_true", help="memory only: each xsched plan's first compiled peak, no timing")
    ap.add_argument("--repeat", type=int, default=1, help="with --fit: plans solved per budget (auto varies)")
    ap.add_argument("--out", type=Path, help="the markdown table, written after every row (--fit: appended)")
    ap.add_argument("--json", type=Path, help="the rows and the run's facts as JSON, written after every row")
    ap.add_argument("--save-plans", type=Path, help="with --fit: each try's first plan saved here (plan<k>.json)")
    ap.add_argument("--plans", type=Path, help="with --fit: run the plans --save-plans saved instead of solving")
    ap.add_argument(
        "--plan", type=Path, action="append", help="timed rows: a plan file run at each of --budgets, in order"
    )
    a = ap.parse_args(argv)
    cuda = a.device.startswith("cuda")
    a.time_limit = a.time_limit or (5.0 if cuda else 20.0)
    a.eager_plan = a.eager_plan if a.eager_plan is not None else not cuda
    a.profile_s = (a.profile_s or (a.deadline / 10 if a.deadline else None)) if a.profile == "measure" else None
    a.argv = argv if argv is not None else sys.argv[1:]
    return a


def capped_profile(model: torch.nn.Module, inputs: tuple, device: str, seconds: float) -> Profile:
    """The profile wrap would measure (of the graph it captures: its outputs' gradients as wrap's default, the
    forward's outputs held by the caller) within `seconds` (ops, then the back-to-back calibration)."""
    graph = capture(model, inputs, name=type(model).__name__, grad_outputs="auto", reuse_blocks=True)
    d = get_device(device)
    if hasattr(d, "nvml"):
        d.nvml = None  # type: ignore[attr-defined]  # NVML energy needs a 0.2 s window per op per round
    return profile_calibrated(held_by_caller(graph), [d], max_total_s=seconds, progress=False)


def planned(
    base: torch.nn.Module,
    inputs: tuple,
    budget: str | int,
    method: str,
    a: argparse.Namespace,
    plan_dev: str,
    time_limit: float,
    profile: Profile | str,
    given: Path | None = None,
    save: Path | None = None,
    clock: PhaseClock | None = None,
) -> tuple[torch.nn.Module, list[str], tuple[float, float]]:
    """wrap(compile=True) settled: steps until its plan is (the first measures the regions; one over the budget
    plans again within less, a re-plan far under it once more within more unless --no-settle, each measured by its
    first step); wrap's notices of them; the seconds wrap took, and the steps until settled (compiles, splits,
    re-plans). `given`: a plan file run instead of solving one (--plans); `save`: where to save the first plan;
    `clock`: where the seconds went (capture, profile, solves, region compiles, the rest of the steps)."""
    clock = clock or PhaseClock()
    t0, timed_before = time.perf_counter(), clock.total()
    with clock.timing():
        w = wrap(
            copy.deepcopy(base),
            inputs,
            {plan_dev: budget},
            method=method,
            time_limit=time_limit,
            profile=profile,
            compile=True,
            plan=Plan.load(given) if given else None,
        )
        w.raise_replans = a.settle  # type: ignore[attr-defined]
        t1 = time.perf_counter()
        clock.add("wrap's rest", (t1 - t0) - (clock.total() - timed_before))
        if save:
            save.parent.mkdir(parents=True, exist_ok=True)
            w._first.plan.save(save)  # type: ignore[attr-defined]
        timed_before = clock.total()
        with contextlib.redirect_stderr(io.StringIO()) as err:
            steps = 0
            while steps < 2 + MAX_SPLITS + 2 * MAX_REPLANS:  # until settled: each first step after a change measures
                steps += 1
                loss_of(w(*inputs)).backward()
                c = w._first  # type: ignore[attr-defined]
                if c.first_run is None and c.replan is None and c.back_to is None:
                    break
    t2 = time.perf_counter()
    clock.add(f"{steps} steps to settle, less the above", (t2 - t1) - (clock.total() - timed_before))
    said = [line for line in err.getvalue().splitlines() if line.startswith("xsched:")]
    return w, said, (t1 - t0, t2 - t1)


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    device = torch.device(a.device)
    cuda = device.type == "cuda"
    deadline = Deadline(a.deadline, a.device)
    if not cuda:
        torch.set_num_threads(a.threads)
    scale = a.scale or ("full:n_layer=6" if cuda else "tiny" if a.smoke else "small")
    z = zoo.build("gpt2", batch=a.batch or (8 if cuda else None), scale=scale)
    inputs = tuple(x.to(device) for x in z.inputs)
    base = z.model.to(device)
    plan_dev = a.device if cuda else "cpu"
    fracs = [float(f) for f in a.budgets.split(",") if f]
    before = sum(p.numel() * p.element_size() for p in base.parameters()) + sum(x.nbytes for x in inputs)
    t_start, load_start = time.perf_counter(), os.getloadavg()
    if a.fit:
        tries = iter(range(10**6))
        m = copy.deepcopy(base)
        ref = step_peak(compiled(m, inputs, 1.0, a.compile_backend), [*m.parameters()], device)

        def fit(frac: float) -> list[str]:
            k = next(tries)
            given, save = (d / f"plan{k}.json" if d else None for d in (a.plans, a.save_plans))
            try:
                budget = before + int(frac * ref)
                w, said, setup = planned(
                    base, inputs, budget, "auto", a, plan_dev, a.time_limit, a.profile, given, save
                )
            except (BudgetError, XschedError) as e:  # a budget below the bound, said as a row, not a traceback
                return [f"| {frac:.0%} | no plan: {str(e).splitlines()[0][:200]} | - | - | - | - | - | - | - |"]
            measured_peak = before + step_peak(lambda: loss_of(w(*inputs)), [*w.parameters()], device)
            return [fit_row(w, said, measured_peak, plan_dev, frac, setup)]

        return fit_table(a, fit, ref)

    here = Path(__file__).resolve().parent
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=here
    ).stdout.strip()
    where = (
        torch.cuda.get_device_name(device) if cuda else f"{platform.machine()} CPU, {torch.get_num_threads()} threads"
    )
    header = [
        f"Command: `python scripts/bench_compile.py {' '.join(a.argv)}`, commit {commit}, {datetime.date.today()}, "
        f"{where}, torch {torch.__version__}; gpt2 {scale}, inputs {[tuple(x.shape) for x in inputs]}, {a.iters} "
        "steps (forward + loss + backward) per row, interleaved with torch.compile's (the ratios are within them)."
    ]
    rows: list[dict] = []
    ref_fn: Callable[[], torch.Tensor] | None = None
    ref_peak: int | None = None
    profile: Profile | str = a.profile
    given_plans = dict(zip(fracs, a.plan or []))

    def publish(final: bool) -> None:
        load = f"{load_start[0]:.1f} at the start, {os.getloadavg()[0]:.1f} now"
        footer = [
            f"- wall time of the run: {time.perf_counter() - t_start:.0f} s",
            f"- machine load (1-minute): {load}",
        ]
        lines = table(rows, header, footer)
        facts = {"command": header[0], "partial": not final, "wall_s": time.perf_counter() - t_start}
        write(lines, rows, facts, a.out, a.json)
        if final:
            print("\n".join(lines), flush=True)

    for kind, frac in row_order(fracs, a.eager_plan):
        label = label_of(kind, frac)
        why = deadline.skip(kind, a.iters, a.time_limit)
        if why is None and kind.startswith("xsched") and ref_peak is None and frac is not None:
            why = "skipped: no torch.compile peak to take a fraction of"
        if why:
            log(f"{label}: {why}")
            rows.append({"row": label, "error": why})
            publish(final=False)
            continue
        log(f"{label}: setting up ({deadline.left():.0f} s left)")
        t0 = time.perf_counter()
        notes: list[str] = []
        predicted = None
        try:
            with deadline.stopping():
                if kind == "torch":
                    m = copy.deepcopy(base)
                    hits = counters["inductor"]["fxgraph_cache_hit"]
                    fn, params = compiled(m, inputs, frac, a.compile_backend), [*m.parameters()]  # type: ignore[arg-type]
                    cached = counters["inductor"]["fxgraph_cache_hit"] > hits
                elif kind == "eager":
                    m = copy.deepcopy(base)
                    fn, params = (lambda m=m: loss_of(m(*inputs))), [*m.parameters()]
                else:
                    clock = PhaseClock()
                    if a.profile_s and not isinstance(profile, Profile):  # measured once, within --profile-s
                        tp = time.perf_counter()
                        profile = capped_profile(base, inputs, plan_dev, a.profile_s)
                        clock.add("profile", time.perf_counter() - tp)
                    budget = "100%" if frac is None else before + int(frac * ref_peak)  # type: ignore[operator]
                    limit = deadline.solve_limit(a.time_limit)
                    method = "eager" if frac is None else "auto"
                    w, said, _ = planned(
                        base, inputs, budget, method, a, plan_dev, limit, profile, given_plans.get(frac), clock=clock
                    )
                    fn, params = (lambda w=w: loss_of(w(*inputs))), [*w.parameters()]
                    notes = [
                        f"budget {budget}, solve time limit {limit:.0f} s",
                        *xsched_notes(w, said, plan_dev, before, clock),
                    ]
                    if isinstance(profile, Profile) and w._first.graph.fingerprint != profile.graph:  # type: ignore[attr-defined]
                        notes.append("the --profile-s profile is not of wrap's graph: wrap measured its own")
                    c = w._first  # type: ignore[attr-defined]
                    predicted = c.plan.predicted.peak_bytes[plan_dev] - before
                setup_s = time.perf_counter() - t0
                if kind.startswith("xsched"):  # the profile is measured once: the next xsched row's setup is without it
                    deadline.setup.setdefault("xsched", []).append(setup_s - clock.seconds.get("profile", 0.0))
                elif kind == "torch" and not cached:  # a compile from inductor's cache says nothing of the next one's
                    deadline.setup.setdefault("torch", []).append(setup_s)
                got = measured(
                    fn,
                    params,
                    ref_fn,
                    a.iters,
                    lambda f, p: step_peak(f, p, device),
                    lambda fs, n: timed(fs, n, device),
                )
        except DeadlineReached:
            rows.append({"row": label, "error": f"stopped: --deadline passed {time.perf_counter() - t0:.0f} s into it"})
            log(f"{label}: {rows[-1]['error']}")
            publish(final=False)
            continue
        except Exception as e:  # no plan, a compile that fails, out of memory: the other rows go on
            what = "no plan" if isinstance(e, (BudgetError, XschedError)) else f"error: {type(e).__name__}"
            rows.append({"row": label, "error": f"{what}: {(str(e).splitlines() or [''])[0][:300]}"})
            log(f"{label}: {rows[-1]['error']}")
            publish(final=False)
            continue
        if label == "torch.compile":
            ref_fn, ref_peak = fn, got["peak"]
            got |= {"ref_time_s": got["time_s"], "ref_best_s": got["best_s"]}
        deadline.step_s = max(deadline.step_s, got["time_s"], got["ref_time_s"] or 0.0)
        rows.append({"row": label, **got, "predicted": predicted, "setup_s": setup_s, "notes": notes})
        log(f"{label}: {got['time_s'] * 1e3:.1f} ms, peak {got['peak']:,} B, set up in {setup_s:.0f} s")
        publish(final=False)
        del fn, params
    publish(final=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
