"""Executor benchmark on one torch device (meant for cuda:0): eager PyTorch against xsched plans at 100/75/50%.

python scripts/bench_cuda.py --device cuda:0 --out docs/bench/cuda.md
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import platform
import re
import statistics
import sys
import time
import traceback
from collections.abc import Callable

import torch
from bench_executor import step_memory  # scripts/ is on sys.path when this file is run as a script
from torch.utils._pytree import tree_flatten

from xsched import zoo
from xsched.capture.torch import bind_inputs, capture
from xsched.contracts.graph import Graph
from xsched.contracts.plan import Compute, Plan
from xsched.contracts.profile import Profile
from xsched.devices import get_device
from xsched.errors import BudgetError, XschedError
from xsched.execute.back_to_back import profile_calibrated
from xsched.execute.executor import Executor
from xsched.execute.run_report import measure
from xsched.solve.api import solve
from xsched.solve.options import SolverOptions

HEADER = (
    "| model | plan | method | step time | vs eager PyTorch | step peak | vs eager PyTorch peak "
    "| predicted / measured peak | predicted / measured time | recomputes |"
)
RULE = "|---|---|---|---|---|---|---|---|---|---|"
PLANS = (("eager plan", "eager", None), ("auto 75%", "auto", "75%"), ("auto 50%", "auto", "50%"))


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def eager_step(model: torch.nn.Module, inputs: tuple, dev: torch.device) -> Callable[[], object]:
    """One eager training step as the captured graph computes it: forward, then backward of every differentiable
    output with ones as its gradient (bind_inputs' default tangents) into fresh .grad tensors."""
    leaves = [o for o in _tensor_leaves(model(*inputs)) if o.requires_grad]
    ones = [torch.ones_like(o) for o in leaves]  # made once, resident like the executor's tangents
    del leaves
    model.zero_grad(set_to_none=True)

    def step() -> object:
        model.zero_grad(set_to_none=True)
        diff = [o for o in _tensor_leaves(model(*inputs)) if o.requires_grad]
        return _Backward(diff, ones)

    return step


class _Backward:
    """What step() returns: `.backward()` runs the step's backward (so bench_executor.step_memory can replay it)."""

    def __init__(self, outs: list[torch.Tensor], grads: list[torch.Tensor], keep: object = None) -> None:
        self.outs, self.grads, self.keep = outs, grads, keep

    def backward(self) -> None:
        if self.outs:
            torch.autograd.backward(self.outs, self.grads)


def _tensor_leaves(out: object) -> list[torch.Tensor]:
    """The forward's tensors, flattened as capture flattens them (nested tuples, lists and dicts)."""
    return [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)]


def eager_times(step: Callable[[], object], dev: torch.device, iters: int, warmup: int) -> list[float]:
    """Wall seconds of `iters` eager steps after `warmup`, the device synchronised around each."""
    out = []
    for i in range(warmup + iters):
        sync(dev)
        t0 = time.perf_counter()
        step().backward()  # type: ignore[attr-defined]
        sync(dev)
        if i >= warmup:
            out.append(time.perf_counter() - t0)
    return out


def eager_peak(step: Callable[[], object], model: torch.nn.Module, dev: torch.device) -> int | None:
    """Bytes one eager step allocates above what is resident before it (params, inputs, tangents)."""
    model.zero_grad(set_to_none=True)
    gc.collect()
    if dev.type == "cuda":
        sync(dev)
        base = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        step().backward()  # type: ignore[attr-defined]
        sync(dev)
        peak = torch.cuda.max_memory_allocated(dev) - base
    elif dev.type == "cpu":  # the CPU allocator's events of one step, replayed (as bench_executor's tables)
        peak = step_memory(step, model.parameters()).peak  # type: ignore[arg-type]
    else:
        return None
    model.zero_grad(set_to_none=True)
    return peak


def cpu_plan_peak(graph: Graph, plan: Plan, env: dict[str, torch.Tensor]) -> int:
    """Bytes one run of the plan on the CPU allocates above its inputs, from the allocator's events."""
    ex = Executor(graph, plan, check=False)
    try:
        ex(env)  # warm-up: anything built on first use is not the step's
        return step_memory(lambda: _Backward([], [], ex(env)), []).peak  # type: ignore[arg-type,return-value]
    finally:
        ex.close()


def profiled(graph: Graph, device: str, seconds: float, energy: bool) -> Profile:
    d = get_device(device)
    if not energy and hasattr(d, "nvml"):
        d.nvml = None  # type: ignore[attr-defined]  # NVML energy needs a 0.2 s window per op per round: skip it
    return profile_calibrated(graph, [d], max_total_s=seconds, progress=False)  # its eager step back to back too


def no_plan(detail: str) -> str:
    """'no plan: <first clause>' of a BudgetError's message, and the smallest budget known to work if it says."""
    first = detail.split(";")[0].split(" (")[0]
    known = re.search(r"smallest budget known to work: \S+ ([\d.]+ \w+)", detail)
    return f"no plan: {first}" + (f"; smallest known to work {known.group(1)}" if known else "")


def one_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}".replace("|", "/")


def fmt_ms(s: float) -> str:
    return f"{s * 1e3:.2f} ms"


def fmt_mib(b: float | None) -> str:
    return "n/a" if b is None else f"{b / 2**20:.1f} MiB"


def ratio(a: float | None, b: float | None, pct: bool = False) -> str:
    if a is None or not b:
        return "n/a"
    return f"{a / b:.0%}" if pct else f"{a / b:.2f}x"


def bench_model(spec: str, device: str, a: argparse.Namespace) -> list[str]:
    """Rows for one model: eager PyTorch, then each plan measured by xsched.execute.run_report.measure."""
    name, _, scale = spec.partition(":")
    scale = scale or "default"
    label = f"{name} ({scale})"
    dev = torch.device(device)
    t0 = time.perf_counter()
    z = zoo.build(name, scale=scale)
    model = z.model.to(dev)
    inputs = tuple(x.to(dev) if isinstance(x, torch.Tensor) else x for x in z.inputs)
    graph = capture(model, inputs, name=f"{name}-{scale}")
    log(f"{label}: captured {len(graph.ops)} ops in {time.perf_counter() - t0:.1f} s; profiling on {device}")
    t0 = time.perf_counter()
    profile = profiled(graph, device, a.profile_s, a.nvml_energy)
    log(f"{label}: profiled in {time.perf_counter() - t0:.1f} s")
    env = bind_inputs(graph, model, inputs)  # on the device: the inputs are there, the ones-tangents made there
    resident = sum(graph.value[v].nbytes for v in graph.inputs)  # params, buffers, inputs, tangents
    step = eager_step(model, inputs, dev)
    e_peak = eager_peak(step, model, dev)
    e_times = eager_times(step, dev, a.iters, a.warmup)
    log(f"{label}: eager PyTorch {fmt_ms(statistics.median(e_times))}, step peak {fmt_mib(e_peak)}")
    results: list[tuple[str, str, object]] = []
    options = SolverOptions(time_limit_s=a.time_limit)
    for plan_label, method, budget in PLANS:
        if budget and time.perf_counter() - a.start + a.time_limit > a.deadline:
            results.append((plan_label, method, f"skipped: past the --deadline of {a.deadline:.0f} s"))
            continue
        t0 = time.perf_counter()
        try:
            plan = solve(graph, profile, {device: budget} if budget else {}, [device], method, options)
            found = plan.solver.found_by
            how = f"{plan.solver.method}" + (f" ({found})" if found != plan.solver.method else "")
            solved = time.perf_counter() - t0
            model.zero_grad(set_to_none=True)
            gc.collect()
            sync(dev)
            base = torch.cuda.memory_allocated(dev) if dev.type == "cuda" else resident
            r = measure(graph, plan, env, profile, iters=a.iters, warmup=a.warmup)
            if dev.type == "cpu":  # the allocator's events, as for eager PyTorch (measure gives the plan's accounting)
                r = dataclasses.replace(r, peak_bytes={device: resident + cpu_plan_peak(graph, plan, env)})
            recomputes = sum(isinstance(s, Compute) for s in plan.steps) - len(graph.ops)
            results.append((plan_label, how, (r, base, recomputes)))
            log(f"{label}: {plan_label} by {how} (solved in {solved:.1f} s): {fmt_ms(r.time_s)}")
        except BudgetError as e:
            results.append((plan_label, method, no_plan(e.detail)))
            log(f"{label}: {plan_label}: no plan ({e.detail})")
            continue
        except Exception as e:  # one plan failing (XschedError, CUDA OOM, ...) must not lose the other rows
            traceback.print_exc()
            results.append((plan_label, method, f"error: {one_line(e)}"))
            continue
        e_times += eager_times(step, dev, a.iters, 1)  # interleaved: eager again after every plan
    e_time = statistics.median(e_times)
    rows = [f"| {label} | eager PyTorch | - | {fmt_ms(e_time)} | 1.00x | {fmt_mib(e_peak)} | 100% | - | - | - |"]
    for plan_label, how, res in results:
        if isinstance(res, str):
            rows.append(f"| {label} | {plan_label} | {how} | {res} | | | | | | |")
            continue
        r, base, recomputes = res  # type: ignore[misc]
        peak = r.peak_bytes[device] - base
        predicted = r.predicted_peak_bytes[device] - resident
        rows.append(
            f"| {label} | {plan_label} | {how} | {fmt_ms(r.time_s)} | {ratio(r.time_s, e_time)} | {fmt_mib(peak)} "
            f"| {ratio(peak, e_peak, pct=True)} | {ratio(predicted, peak)} | {ratio(r.predicted_time_s, r.time_s)} "
            f"| {recomputes} |"
        )
    return rows


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def device_name(dev: torch.device) -> str:
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    from xsched.devices.cpu import cpu_model

    return f"{cpu_model()['brand']}, torch threads: {torch.get_num_threads()}"


NOTES = """\
Step = forward + backward of every differentiable output with ones as its gradient (what the captured graph
computes), parameters' .grad set to None first. Times: medians of wall times with the device synchronised around
each step; eager PyTorch is measured before the plans and again after each (all of them pooled), each plan by
`xsched.execute.run_report.measure` after its warm-up. `step peak`: bytes allocated above what is resident before the
step (params, buffers, inputs, tangents): on CUDA `max_memory_allocated` less `memory_allocated` before; on the
CPU the allocator events of one step (bench_executor.step_memory), for the plans too (one more run of each).
Budgets are % of the eager plan's simulated peak on this device's profile (params and inputs included).
`predicted / measured`: the simulator on the profile against the measured run (the profile's fidelity)."""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--models", default="resnet18:default,gpt2:default,vgg16:default,mlp_mixer:default,unet:default")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3, help="untimed runs before each measurement")
    ap.add_argument("--profile-s", type=float, default=30.0, help="profiling time cap per model (then quick rounds)")
    ap.add_argument("--time-limit", type=float, default=20.0, help="solver time limit per plan, seconds")
    ap.add_argument("--threads", type=int, help="torch intra-op threads (default: 1 on the CPU, torch's on CUDA)")
    ap.add_argument("--nvml-energy", action="store_true", help="measure op energy with NVML while profiling (slow)")
    ap.add_argument("--deadline", type=float, default=420.0, help="seconds from the start: no auto solve after it")
    ap.add_argument("--out", help="also write the markdown here (rewritten after every model)")
    a = ap.parse_args(argv)
    dev = torch.device(a.device)
    if a.threads or dev.type == "cpu":
        torch.set_num_threads(a.threads or 1)
    cmd = " ".join(["python scripts/bench_cuda.py", *(sys.argv[1:] if argv is None else argv)])
    lines = [
        f"# Executor on {a.device}",
        "",
        f"Command: `{cmd}`  ",
        f"Device: {device_name(dev)}; torch {torch.__version__} (CUDA {torch.version.cuda}), Python "
        f"{platform.python_version()}, TF32 matmul {torch.backends.cuda.matmul.allow_tf32}",
        "",
        HEADER,
        RULE,
    ]
    log(lines[2] + " " + lines[3])
    a.start = time.perf_counter()
    for spec in a.models.split(","):
        try:
            rows = bench_model(spec, a.device, a)
        except XschedError as e:
            rows = [f"| {spec} | error | | {one_line(e)} | | | | | | |"]
        except Exception as e:  # the run is precious: report and go on
            traceback.print_exc()
            rows = [
                f"| {spec} | error | | {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''} | | | | | | |"
            ]
        lines += rows
        print("\n".join(rows), flush=True)
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        text = "\n".join([*lines, "", NOTES]) + "\n"
        if a.out:  # after every model: a run cut short keeps what it measured
            with open(a.out, "w") as f:
                f.write(text)
    log(f"done in {time.perf_counter() - a.start:.0f} s")
    print("\n" + text, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
