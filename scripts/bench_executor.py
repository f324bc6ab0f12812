"""Executor benchmark on CPU: overhead of the eager plan against plain PyTorch, and time and memory at 50% and
25% budgets beside torch.utils.checkpoint.checkpoint_sequential and torch.compile's activation_memory_budget.

    python scripts/bench_executor.py --out docs/bench/executor.md

All times are medians of interleaved iterations measured in this one process (so ratios share the machine's
load). Memory: xsched's figures are the executor's resident-byte accounting (equal to the simulator's);
for the PyTorch baselines, which have no CPU allocator statistics, we count the bytes saved for backward
(saved_tensors_hooks, distinct storages, parameters and the input excluded). The same count is taken for
xsched: the activations resident at the autograd boundary.
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint_sequential

from xsched import zoo
from xsched.budgets import format_bytes
from xsched.capture.torch import bind_inputs, capture
from xsched.execute.compiled import compile_op
from xsched.execute.executor import Executor
from xsched.execute.wrap import wrap
from xsched.plan import Compute
from xsched.simulate import simulate
from xsched.solve.eager import eager_plan


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
        "| model | ops | eager PyTorch step | xsched eager plan step | overhead | in-place reuse off | overhead | reused | kernels only (no autograd) | executor run | executor overhead |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]  # fmt: skip
    for name, scale in models:
        z = zoo.build(name, scale=scale)
        plain = z.model
        wrapped = wrap(copy.deepcopy(z.model), z.inputs, {"cpu": "100%"}, method="eager")
        allocating = wrap(copy.deepcopy(z.model), z.inputs, {"cpu": "100%"}, method="eager", inplace=False)
        steps = {k: train_step(m, z.inputs, torch.optim.SGD(m.parameters(), lr=1e-3))
                 for k, m in (("eager", plain), ("xsched", wrapped), ("no-inplace", allocating))}  # fmt: skip
        # the executor alone against a bare loop over the same pre-decoded kernels: its per-step cost
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
    """Bytes of distinct storages saved for backward by one forward (parameters and the input excluded)."""
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
    """(plan peak, activations resident at the autograd boundary, recomputed ops) of a wrapped module's plan."""
    c = next(iter(w.compiled.values()))  # type: ignore[attr-defined]
    sim = simulate(c.graph, c.plan)
    fixed = sum(c.graph.value[v].nbytes for v in c.graph.inputs)
    at_boundary = sum(sim.resident_after[c.plan.boundary - 1].values()) - fixed
    recomputes = sum(isinstance(s, Compute) for s in c.plan.steps) - len(c.graph.ops)
    return max(sim.peak_bytes.values()), at_boundary, recomputes


def budget_rows(depth: int, width: int, batch: int, iters: int, compile_too: bool) -> list[str]:
    base = deep_mlp(depth, width)
    x = torch.randn(batch, width, generator=torch.Generator().manual_seed(1), requires_grad=True)
    models: dict[str, nn.Module] = {"eager PyTorch": copy.deepcopy(base)}
    fwds: dict[str, Callable[[], torch.Tensor]] = {"eager PyTorch": lambda m=models["eager PyTorch"]: loss_of(m(x))}
    figures: dict[str, tuple[int | None, int | None, int | None]] = {}
    notes = []
    for label, budget in (("xsched eager plan", "100%"), ("xsched 50%", "50%"), ("xsched 25%", "25%")):
        m = copy.deepcopy(base)
        w, used = smallest_feasible(m, x, int(budget[:-1]))
        if used != budget:
            label = f"xsched {used} (smallest feasible from {budget})"
            notes.append(f"{budget} of the eager peak: the heuristics (auto: eager, checkpoint, greedy, sqrt) raise "
                         f"BudgetError; {used} is the smallest feasible budget in 5% steps")  # fmt: skip
        models[label] = w
        fwds[label] = lambda w=w: loss_of(w(x))
        figures[label] = xsched_figures(w)
    for segments in (2, 3, 4, 6, 8, 12):
        m = copy.deepcopy(base)
        label = f"checkpoint_sequential, {segments} segments"
        models[label] = m
        fwds[label] = lambda m=m, s=segments: loss_of(checkpoint_sequential(m, s, x, use_reentrant=True))
    if compile_too:
        import torch._dynamo as dynamo
        import torch._functorch.config as functorch_config

        for frac in (1.0, 0.5, 0.25):
            m = copy.deepcopy(base)
            label = f"torch.compile, activation_memory_budget={frac}"
            with functorch_config.patch(activation_memory_budget=frac):
                dynamo.reset()
                cm = torch.compile(m)
                t0 = time.perf_counter()
                loss_of(cm(x)).backward()  # compiles forward and backward under this budget
                notes.append(f"{label}: compiled in {time.perf_counter() - t0:.1f} s")
            models[label] = m
            fwds[label] = lambda cm=cm: loss_of(cm(x))
    saved = {k: saved_bytes(models[k], f, x) for k, f in fwds.items()}
    times = interleaved({k: (lambda f=f: f().backward()) for k, f in fwds.items()}, iters)
    peak0 = figures["xsched eager plan"][0]
    rows = [
        f"Deep MLP: {depth} x (Linear({width},{width}) + ReLU) + Linear({width},10), batch {batch}, "
        f"loss mean(out^2), forward+backward.",
        "",
        "| method | step time | vs eager | saved for backward | plan peak (xsched) | peak vs eager plan | recomputed ops |",
        "|---|---|---|---|---|---|---|",
    ]  # fmt: skip
    for k in fwds:
        peak, boundary, recomputes = figures.get(k, (None, None, None))
        shown = saved[k] if boundary is None else boundary
        held = "n/a (see note)" if k.startswith("torch.compile") else format_bytes(shown)
        rows.append(
            f"| {k} | {times[k] * 1e3:.2f} ms | {times[k] / times['eager PyTorch']:.2f}x | {held} "
            f"| {format_bytes(peak) if peak else '-'} | {f'{peak / peak0:.0%}' if peak else '-'} "
            f"| {recomputes if recomputes is not None else '-'} |"
        )
        print(rows[-1], flush=True)
    compiled = [k for k in saved if k.startswith("torch.compile")]
    if compiled:
        notes.append(
            "torch.compile rows: memory not measured. On CPU there are no allocator statistics, and "
            "saved_tensors_hooks see only part of what the compiled autograd function keeps ("
            + ", ".join(f"{format_bytes(saved[k])} at {k.split('=')[1]}" for k in compiled)
            + ", less than one activation per layer), so the budget fraction is the only match to the xsched rows."
        )
    rows += ["", *[f"- {n}" for n in notes]]
    rows.append(
        f"- saved for backward, measured by hooks for the PyTorch rows: eager PyTorch {format_bytes(saved['eager PyTorch'])}; "
        f"for xsched rows the activations resident at the autograd boundary (hooks see nothing inside the plan function)."
    )
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: steadier on a shared box)")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile rows")
    ap.add_argument("--depth", type=int, default=24)
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--batch", type=int, default=2048)
    ap.add_argument("--models", default="resnet18:small,gpt2:small,mlp_mixer:small,vgg16:small,"
                    "resnet18:default,gpt2:default,mlp_mixer:default,vgg16:default")  # fmt: skip
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
        "",
        "## Overhead of the eager plan (one device, no recomputation)",
        "",
        "Training step = zero_grad + forward + loss + backward + SGD step, the same model, inputs and thread count",
        "for every column, medians of interleaved iterations. `in-place reuse off`: the wrapped step with",
        "`wrap(..., inplace=False)` (every captured op allocates its output); `reused`: compute steps run in place",
        "on an input the plan frees right after them. `kernels only`: the eager plan's computes and frees as a bare",
        "loop over the pre-decoded ops on a plain dict (no autograd, stores, accounting or checks); `executor run`:",
        "the same plan through the executor.",
        "",
        *overhead_rows(models, a.iters),  # type: ignore[arg-type]
        "",
        "## Budgets: 50% and 25% of the eager peak",
        "",
        *budget_rows(a.depth, a.width, a.batch, a.iters, not a.no_compile),
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
