"""Executor benchmark on CPU: overhead of the eager plan against plain PyTorch, and time and memory at 50% and
25% budgets beside torch.utils.checkpoint.checkpoint_sequential and torch.compile's activation_memory_budget.

    python scripts/bench_executor.py --out docs/bench/executor.md

All times are medians of interleaved iterations measured in this one process (so ratios share the machine's
load). Memory, for every row alike: the CPU allocator's allocation and free events of one step, recorded by
torch.profiler and replayed (step_memory); checked in the run against saved_tensors_hooks for the PyTorch rows
and against the simulator for the xsched rows."""

from __future__ import annotations

import argparse
import copy
import gc
import os
import platform
import statistics
import sys
import time
import types
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile, record_function
from torch.utils.checkpoint import checkpoint_sequential

from xsched import zoo
from xsched.budgets import format_bytes
from xsched.capture.torch import bind_inputs, capture
from xsched.contracts.plan import Compute
from xsched.execute.compiled import compile_op
from xsched.execute.executor import Executor
from xsched.execute.wrap import wrap
from xsched.simulate import simulate
from xsched.solve.reference import eager_plan

OVERHEAD_INTRO = """## Overhead of the eager plan (one device, no recomputation)

Training step = zero_grad + forward + loss + backward + SGD step, the same model, inputs and thread count
for every column, medians of interleaved iterations. `in-place reuse off`: the wrapped step with
`wrap(..., inplace=False)` (every captured op allocates its output); `reused`: compute steps run in place
on an input the plan frees right after them. `per-op closure loop`: the eager plan's computes and frees as a
plain loop calling the per-op closures on a plain dict (no autograd, stores, accounting or checks); `executor
run`: the same plan through the executor (one generated function per one-device run, so it can be faster).""".splitlines()

BUDGET_INTRO = """## Budgets: 50% and 25% of the eager peak

Step = forward + loss + backward (no optimizer), times are medians of interleaved iterations. Memory is
measured the same way for every row: one step under `torch.profiler.profile(profile_memory=True)`, its CPU
allocator events (every allocation and free with its address, eager or from torch.compile's C++ kernels)
replayed in time order. `peak during step`: the most bytes the step had allocated and not yet freed at any
moment; `held after forward`: what was still allocated when the loss was returned, i.e. what forward keeps for
backward. Params and the input exist before the step and are not counted; grads are set to None before it,
so both columns include what backward allocates for them. `simulator`: the xsched plan's simulated peak less
the params and the input, the prediction of `peak during step` (see the cross-checks under the table).""".splitlines()

# The text from this line on in an existing --out file is written by hand and kept when the file is rewritten.
HAND_WRITTEN = "<!-- written by hand from here on: bench_executor.py keeps it when it rewrites this file -->"


def loss_of(out: object) -> torch.Tensor:
    if isinstance(out, tuple):  # gpt2 returns (logits, loss)
        return out[1]
    return out.float().square().mean()  # type: ignore[union-attr]


def interleaved(fns: dict[str, Callable[[], object]], iters: int, warmup: int = 2) -> dict[str, float]:
    """Median seconds per call of each fn, calls interleaved so slow phases of a shared machine hit all alike."""
    for _ in range(warmup):
        for f in fns.values():
            f()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(iters):
        for k, f in fns.items():
            t0 = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def train_step(model: nn.Module, inputs: tuple, opt: torch.optim.Optimizer) -> Callable[[], None]:
    def step() -> None:
        opt.zero_grad(set_to_none=True)
        loss_of(model(*inputs)).backward()
        opt.step()

    return step


def overhead_rows(models: list[tuple[str, str]], iters: int) -> list[str]:
    rows = [
        "| model | ops | eager PyTorch step | xsched eager plan step | overhead | in-place reuse off | overhead | reused | per-op closure loop (no autograd) | executor run | executor vs loop |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, scale in models:
        z = zoo.build(name, scale=scale)
        plain = z.model
        wrapped = wrap(copy.deepcopy(z.model), z.inputs, {"cpu": "100%"}, method="eager")
        allocating = wrap(copy.deepcopy(z.model), z.inputs, {"cpu": "100%"}, method="eager", inplace=False)
        steps = {
            k: train_step(m, z.inputs, torch.optim.SGD(m.parameters(), lr=1e-3))
            for k, m in (("eager", plain), ("xsched", wrapped), ("no-inplace", allocating))
        }
        # the executor alone against a plain loop calling the same per-op closures (not a floor: the executor runs
        # one-device slices as generated code, which skips the closures' per-argument Python)
        graph = capture(copy.deepcopy(z.model), z.inputs)
        plan = eager_plan(graph, "cpu")
        env = bind_inputs(graph, z.model, z.inputs)
        ex = Executor(graph, plan)
        kernel = {o.id: (o.outputs, compile_op(o, torch.device("cpu"))) for o in graph.ops}
        program = [kernel[s.op] if isinstance(s, Compute) else s.value for s in plan.steps]

        def bare(env: dict = env, program: list = program) -> None:
            """The plan's computes and frees on a plain dict: no stores, accounting, checks or RNG log."""
            store = dict(env)
            with torch.no_grad():
                for step in program:
                    if isinstance(step, str):
                        del store[step]
                    else:
                        store.update(zip(step[0], step[1](store)))

        t = interleaved({**steps, "bare": bare, "executor": lambda ex=ex, env=env: ex(env)}, iters)
        reused = len(next(iter(wrapped.compiled.values())).executor.reuse)
        rows.append(
            f"| {name} ({scale}) | {len(graph.ops)} | {t['eager'] * 1e3:.2f} ms | {t['xsched'] * 1e3:.2f} ms "
            f"| {100 * (t['xsched'] / t['eager'] - 1):+.1f}% | {t['no-inplace'] * 1e3:.2f} ms "
            f"| {100 * (t['no-inplace'] / t['eager'] - 1):+.1f}% | {reused} | {t['bare'] * 1e3:.2f} ms "
            f"| {t['executor'] * 1e3:.2f} ms | {100 * (t['executor'] / t['bare'] - 1):+.1f}% |"
        )
        print(rows[-1], flush=True)
        ex.close()
    return rows


def deep_mlp(depth: int, width: int) -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, 10)).train()


def saved_bytes(model: nn.Module, fwd: Callable[[], torch.Tensor], x: torch.Tensor) -> int:
    """Bytes of distinct storages saved for backward by one forward (parameters and the input excluded): the
    cross-check of StepMemory.held for the PyTorch rows (hooks see nothing inside xsched's plan function)."""
    skip = {p.untyped_storage().data_ptr() for p in model.parameters()} | {x.untyped_storage().data_ptr()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s.data_ptr() not in skip:
            seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = fwd()
    loss.backward()
    return sum(seen.values())


@dataclass(frozen=True)
class StepMemory:
    """CPU bytes allocated during one forward + loss + backward and not yet freed, from the allocator's events."""

    peak: int  # the most live at any moment of the step: the step's memory above what existed before it
    held: int  # live when the loss was returned: what the step keeps from forward for backward (+ loss, output)
    end: int  # live after backward: the gradients (they are set to None before the step)


_FORWARD_DONE = "bench_executor::forward_done"
LOSS_BYTES = 4  # the float32 loss scalar


def step_memory(loss_fn: Callable[[], torch.Tensor], params: Iterable[torch.Tensor]) -> StepMemory:
    """Run `loss_fn().backward()` once under the profiler and replay its CPU allocation events in time order.

    Every CPU tensor, eager or from torch.compile's C++ kernels (they allocate through empty_strided), goes
    through the CPU allocator, which reports each allocation and free to the profiler with its address. Frees of
    blocks allocated before the step (the grads of `params`, set to None first, or a previous step's garbage)
    are ignored, so the figures count only what this step allocated. Allocations on threads the profiler does
    not follow would be missed: the executor runs one-device plans inline, and CPU backward runs on this thread.
    """
    for p in params:
        p.grad = None
    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        loss = loss_fn()
        with record_function(_FORWARD_DONE):
            pass
        loss.backward()
        del loss
    nodes, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        n = stack.pop()
        nodes.append(n)
        stack.extend(n.children)
    mark = min(n.start_time_ns for n in nodes if n.name == _FORWARD_DONE)
    allocs = sorted(
        (n for n in nodes if n.tag == _EventType.Allocation and n.extra_fields.device.type == "cpu"),
        key=lambda n: n.start_time_ns,
    )
    live: dict[int, int] = {}
    now = peak = 0
    held = None
    for n in allocs:
        if held is None and n.start_time_ns > mark:
            held = now
        ptr, size = n.extra_fields.ptr, n.extra_fields.alloc_size
        if size > 0:
            live[ptr] = size
            now += size
        elif ptr in live:
            now -= live.pop(ptr)
        peak = max(peak, now)
    return StepMemory(peak, now if held is None else held, now)


def smallest_feasible(m: nn.Module, x: torch.Tensor, percent: int) -> tuple[nn.Module, str]:
    """wrap(m) at `percent`% of the eager peak, or at the smallest feasible budget above it (5% steps)."""
    from xsched.errors import BudgetError

    for p in range(percent, 101, 5):
        try:
            return wrap(m, (x,), {"cpu": f"{p}%"}, method="eager" if p == 100 else "auto"), f"{p}%"
        except BudgetError:
            continue
    raise AssertionError("the eager plan always fits 100%")


def xsched_figures(w: nn.Module) -> tuple[int, int, int]:
    """(plan peak, plan peak less the params and inputs, recomputed ops) of a wrapped module's plan. Params and
    inputs exist before a step, so StepMemory.peak does not see them; the tangent (d loss / d output) is
    allocated during the step, so it stays in."""
    c = next(iter(w.compiled.values()))  # type: ignore[attr-defined]
    peak = max(simulate(c.graph, c.plan).peak_bytes.values())
    before = sum(c.graph.value[v].nbytes for v in c.graph.inputs if c.graph.value[v].kind != "tangent")
    recomputes = sum(isinstance(s, Compute) for s in c.plan.steps) - len(c.graph.ops)
    return peak, peak - before, recomputes


def _call(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return m(x)


def compiled_under(m: nn.Module, x: torch.Tensor, frac: float) -> tuple[Callable[[], torch.Tensor], float]:
    """A loss function running torch.compile'd `m`, its forward and backward partitioned under
    activation_memory_budget=frac, and the compile time (AOT-autograd and FX-graph caches off; the C++
    kernels may still come from inductor's on-disk cache).

    Dynamo keeps compiled code per code object and inlines nn.Modules, so copies of one model share one
    compiled graph whatever the budget was when it was built; each budget gets its own copy of `_call`'s code.
    """
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    code = _call.__code__.replace(co_name=f"_call_budget_{frac}", co_qualname=f"_call_budget_{frac}")
    fn = torch.compile(types.FunctionType(code, globals()))
    with (
        functorch_config.patch(activation_memory_budget=frac, enable_autograd_cache=False),
        inductor_config.patch(fx_graph_cache=False),
    ):
        t0 = time.perf_counter()
        loss_of(fn(m, x)).backward()  # compiles forward and backward under this budget
        took = time.perf_counter() - t0
    return (lambda: loss_of(fn(m, x))), took


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def budget_rows(depth: int, width: int, batch: int, iters: int, compile_too: bool) -> list[str]:
    base = deep_mlp(depth, width)
    x = torch.randn(batch, width, generator=torch.Generator().manual_seed(1), requires_grad=True)
    models: dict[str, nn.Module] = {"eager PyTorch": copy.deepcopy(base)}
    fwds: dict[str, Callable[[], torch.Tensor]] = {"eager PyTorch": lambda m=models["eager PyTorch"]: loss_of(m(x))}
    figures: dict[str, tuple[int, int, int]] = {}
    notes = []
    for label, budget in (("xsched eager plan", "100%"), ("xsched 50%", "50%"), ("xsched 25%", "25%")):
        w, used = smallest_feasible(copy.deepcopy(base), x, int(budget[:-1]))
        if used != budget:
            label = f"xsched {used} (smallest feasible from {budget})"
            notes.append(
                f"{budget} of the eager peak: the heuristics (auto: eager, checkpoint, greedy, sqrt) raise "
                f"BudgetError; {used} is the smallest feasible budget in 5% steps"
            )
        models[label] = w
        fwds[label] = lambda w=w: loss_of(w(x))
        figures[label] = xsched_figures(w)
    for segments in (2, 3, 4, 6, 8, 12):
        m = copy.deepcopy(base)
        label = f"checkpoint_sequential, {segments} segments"
        models[label] = m
        fwds[label] = lambda m=m, s=segments: loss_of(checkpoint_sequential(m, s, x, use_reentrant=True))
    if compile_too:
        for frac in (1.0, 0.5, 0.25):
            label = f"torch.compile, activation_memory_budget={frac}"
            models[label] = copy.deepcopy(base)
            fwds[label], took = compiled_under(models[label], x, frac)
            notes.append(f"{label}: compiled in {took:.1f} s (AOT-autograd and FX-graph caches off)")
    with torch.compiler.set_stance("fail_on_recompile"):  # every compiled row runs what its budget compiled
        for f in fwds.values():  # warm-up: anything built on first use is not counted as the step's
            f().backward()
        mem = {k: step_memory(f, [*models[k].parameters(), x]) for k, f in fwds.items()}
        saved = {k: saved_bytes(models[k], f, x) for k, f in fwds.items() if k not in figures}
        times = interleaved({k: (lambda f=f: f().backward()) for k, f in fwds.items()}, iters)
    e = mem["eager PyTorch"]
    rows = [
        f"Deep MLP: {depth} x (Linear({width},{width}) + ReLU) + Linear({width},10), batch {batch}, "
        f"loss mean(out^2), forward+backward.",
        "",
        "| method | step time | vs eager | held after forward | vs eager | peak during step | vs eager "
        "| simulator: plan peak - params - input | recomputed ops |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for k in fwds:
        m, (_, predicted, recomputes) = mem[k], figures.get(k, (0, None, None))
        rows.append(
            f"| {k} | {times[k] * 1e3:.2f} ms | {times[k] / times['eager PyTorch']:.2f}x | {_mib(m.held)} "
            f"| {m.held / e.held:.0%} | {_mib(m.peak)} | {m.peak / e.peak:.0%} "
            f"| {_mib(predicted) if predicted is not None else '-'} | {recomputes if recomputes is not None else '-'} |"
        )
        print(rows[-1], flush=True)
    rows += ["", *[f"- {n}" for n in notes]]
    plan0, predicted0, _ = figures["xsched eager plan"]
    ends = sorted({format_bytes(m.end) for m in mem.values()})
    rows += [
        f"- xsched budgets are fractions of the eager plan's simulated peak ({format_bytes(plan0)}), which counts "
        f"the params and the input ({format_bytes(plan0 - predicted0)}); the memory columns do not, so a budget "
        "lands lower there.",
        "- Cross-check against saved_tensors_hooks (bytes of distinct storages saved for backward, params and input "
        "excluded), held after forward minus hooks: "
        + "; ".join(f"{k} {mem[k].held - b:+,} B" for k, b in saved.items())
        + f". Expected: +{LOSS_BYTES} B, the loss; checkpoint_sequential also keeps the CPU RNG state "
        f"({torch.get_rng_state().nbytes:,} B) for each checkpointed segment.",
        "- Cross-check against the simulator, peak during step minus (plan peak - params - input): "
        + "; ".join(f"{k} {mem[k].peak - figures[k][1]:+,} B" for k in figures)
        + f". Expected: +{2 * LOSS_BYTES} B (the loss and its gradient, outside the plan) with in-place reuse off "
        "(tests/test_bench_executor.py); with it, less where a compute ran in place on an input freed right after "
        "it (the simulator counts both buffers until the free, the allocator one).",
        f"- Left after backward (the gradients, set to None before each step): {', '.join(ends)}.",
    ]
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: steadier on a shared box)")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile rows")
    ap.add_argument("--depth", type=int, default=24)
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--batch", type=int, default=2048)
    ap.add_argument(
        "--models",
        default="resnet18:small,gpt2:small,mlp_mixer:small,vgg16:small,"
        "resnet18:default,gpt2:default,mlp_mixer:default,vgg16:default",
    )
    ap.add_argument("--tables", choices=("all", "overhead", "budgets"), default="all", help="which tables to run")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    models = [tuple(m.split(":")) for m in a.models.split(",") if m]
    lines = [
        "# Executor benchmark (CPU)",
        "",
        f"Command: `python {' '.join(['scripts/bench_executor.py', *(argv if argv is not None else sys.argv[1:])])}`  ",
        f"Machine: {platform.machine()}, {torch.get_num_threads()} torch thread(s), torch {torch.__version__}, "
        f"Python {platform.python_version()}; a 2-core VM shared with other jobs that ran alongside (load average "
        f"{os.getloadavg()[0]:.1f} at the start): expect +-5-10% noise between runs.",
    ]
    if a.tables in ("all", "overhead"):
        lines += ["", *OVERHEAD_INTRO, "", *overhead_rows(models, a.iters)]  # type: ignore[arg-type]
    if a.tables in ("all", "budgets"):
        lines += ["", *BUDGET_INTRO, "", *budget_rows(a.depth, a.width, a.batch, a.iters, not a.no_compile)]
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        kept = a.out.read_text().partition(HAND_WRITTEN)[1:] if a.out.exists() else ()
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(text + ("\n" + "".join(kept) if kept and kept[0] else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
