"""`xsched demo`: the whole main job on one zoo model — capture, profile this machine plus a GPU, a what-if report
with a budget sweep, and one plan trained for real through `xsched.wrap` and checked against eager PyTorch."""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from xsched.budgets import format_bytes
from xsched.contracts.plan import Plan

if TYPE_CHECKING:  # the run imports torch and the pipeline; `xsched --help` reads only DemoSettings
    import torch

    from xsched.contracts.graph import Graph


@dataclass(frozen=True)
class DemoSettings:
    """The embedded default: GPT-2 at scale "small" (228 ops as a GPU runs it; activations dominate its memory, so
    budgets matter), this CPU and a GPU (a real one when CUDA is here, else the roofline model of an RTX 4090), the
    CPU-only plan trained for real at `cpu_budget` of its eager peak."""

    model: str = "gpt2"
    scale: str = "small"
    gpu: str = ""  # "" : cuda:0 when available, else sim:rtx4090
    cpu_budget: str = "50%"
    out: str = "xsched-demo"
    time_limit_s: float = 2.0  # per plan of the report's sweeps
    solve_s: float = 20.0  # for the plan trained for real
    points: int = 6
    steps: int = 10  # timed training steps, after the warm-up (every step is compared with eager)
    warmup: int | None = None  # warm-up steps (None: until the step time settles)
    profile_s: float = 30.0  # profiling's time cap (max_total_s): ops it leaves unmeasured are modelled
    progress: bool = True


def run_demo(s: DemoSettings = DemoSettings(), say: Callable[[str], None] = print) -> int:
    """Run the showcase; 0 when the trained plan matches eager PyTorch, 1 when it does not."""
    import torch

    from xsched.capture.torch import capture
    from xsched.devices.spec import target_device_type
    from xsched.execute.back_to_back import profile_calibrated
    from xsched.report.build import ReportSettings, build_report, check_settings
    from xsched.report.machines import parse_machine
    from xsched.report.sweep import SweepSettings
    from xsched.solve.api import solve
    from xsched.solve.options import SolverOptions
    from xsched.solve.reference import eager_plan
    from xsched.zoo import build

    gpu = s.gpu or ("cuda:0" if torch.cuda.is_available() else "sim:rtx4090")
    settings = ReportSettings(
        SweepSettings("auto", s.time_limit_s, s.points), ("sweep", "energy", "pictures"), progress=s.progress
    )
    check_settings(settings)  # matplotlib present: before any work
    start = time.perf_counter()
    z = build(s.model, scale=s.scale)
    typed = target_device_type(["cpu", gpu])  # the graph its GPU runs (fused dropout), a real GPU or a model of one
    graph = capture(copy.deepcopy(z.model), z.inputs, name=f"{s.model}-{s.scale}", device_type=typed)
    say(f"1. captured {graph.name}: {len(graph.ops)} ops, {len(graph.values)} values ({_since(start)})")
    t0 = time.perf_counter()
    # as wrap and `xsched train` measure: the ops alone, then each real device's eager step back to back
    profile = profile_calibrated(graph, ["cpu", gpu], max_total_s=s.profile_s, progress=s.progress)
    kind = "measured" if gpu.startswith("cuda") else "a roofline model of its spec (no GPU here)"
    steps = f"; eager steps back to back on {', '.join(profile.back_to_back)}" if profile.back_to_back else ""
    say(f"2. profiled every op on cpu (measured) and {gpu} ({kind}) in {_since(t0)}{steps}")
    t0 = time.perf_counter()
    machine = parse_machine(f"{gpu}+cpu")
    report = build_report(graph, profile, [machine], Path(s.out), settings, "xsched demo")
    say(
        f"3. what-if report (budget sweeps of {gpu} and cpu, energy, plan pictures) in {_since(t0)}: "
        f"{report.html.resolve()}"
    )
    knee = Plan.load(report.files["plan.json"])
    budgets = ", ".join(f"{d} {format_bytes(b)}" for d, b in knee.budgets.items())
    say(f"   the plan it pictures ({budgets}): {knee.predicted.time_s * 1e3:.3g} ms per iteration predicted")
    worst = _reference_check(graph, knee, z.model, z.inputs)
    say(
        f"   that plan run step by step (reference interpreter"
        f"{'' if gpu.startswith('cuda') else f', the {gpu} steps on the CPU'}): max |difference| from eager "
        f"{worst:.3g}"
    )
    t0 = time.perf_counter()
    # the CPU alone runs the CPU's kernels: its own graph (the report's where no dropout or dtype differs)
    cpu_graph = (
        graph
        if typed == "cpu"
        else capture(copy.deepcopy(z.model), z.inputs, name=f"{s.model}-{s.scale}", device_type="cpu")
    )
    cpu = profile  # its costs on the CPU are in the report's profile (measured again alone beside a real GPU)
    if cpu_graph.fingerprint != graph.fingerprint or gpu.startswith("cuda"):
        cpu = profile_calibrated(cpu_graph, ["cpu"], max_total_s=s.profile_s, progress=False)
    plan = solve(cpu_graph, cpu, {"cpu": s.cpu_budget}, options=SolverOptions(time_limit_s=s.solve_s))
    eager = eager_plan(cpu_graph, "cpu", cpu)
    say(
        f"4. planned the CPU alone at {s.cpu_budget} of its eager peak in {_since(t0)}: peak "
        f"{format_bytes(plan.predicted.peak_bytes['cpu'])} of {format_bytes(eager.predicted.peak_bytes['cpu'])}, "
        f"predicted {plan.predicted.time_s / eager.predicted.time_s:.2f}x the eager time "
        f"({plan.solver.status}, found by {plan.solver.found_by})"
    )
    same, ratio = _train_against_eager(z.model, z.inputs, plan, s.steps, s.warmup)
    say(
        f"5. trained through xsched.wrap with that plan: losses and parameters at every step "
        f"{'equal' if same else 'DIFFER from'} eager PyTorch's; measured step time {ratio:.2f}x eager's (medians of "
        f"{s.steps}, interleaved)"
    )
    say(f"done in {_since(start)}; open {report.html.resolve()}")
    return 0 if same and worst <= 1e-4 else 1


def _since(t0: float) -> str:
    return f"{time.perf_counter() - t0:.1f} s"


def _reference_check(graph: Graph, plan: Plan, model: torch.nn.Module, inputs: tuple) -> float:
    """Largest absolute difference between the plan's outputs and gradients and eager PyTorch's, same seed."""
    import torch

    from xsched.capture.torch import bind_inputs, unpack_outputs
    from xsched.execute.reference import run_plan

    model = copy.deepcopy(model)
    state = copy.deepcopy(model.state_dict())
    torch.manual_seed(0)
    out = model(*inputs)
    outs = out if isinstance(out, tuple) else (out,)
    tangents = tuple(torch.ones_like(o) for o in outs if o.requires_grad)
    torch.autograd.backward([o for o in outs if o.requires_grad], tangents)
    want = {n: p.grad for n, p in model.named_parameters()}
    model.load_state_dict(state)
    torch.manual_seed(0)
    got = unpack_outputs(graph, run_plan(graph, plan, bind_inputs(graph, model, tuple(inputs), tangents)))
    diffs = [(a - b).abs().max().item() for a, b in zip(got.outputs, outs)]
    diffs += [(got.grads[n] - g).abs().max().item() for n, g in want.items() if g is not None]
    return max(diffs, default=0.0)


def _loss(out: object) -> torch.Tensor:
    if isinstance(out, tuple):  # gpt2 returns (logits, loss)
        return out[1]
    return out.float().square().mean()  # type: ignore[union-attr]


def _train_against_eager(
    model: torch.nn.Module, inputs: tuple, plan: Plan, steps: int, warmup: int | None
) -> tuple[bool, float]:
    """SGD steps of the model eagerly and through wrap(plan=...), same seeds: (all losses and parameters equal within
    1e-5, median wrapped step time over eager's). Each is warmed up until its step time settles, then `steps` steps
    of each are timed, interleaved (so both see the machine's load alike); every step is compared."""
    import torch

    from xsched.execute.run_report import warm_up
    from xsched.execute.wrap import wrap

    eager_model, xs_model = copy.deepcopy(model), copy.deepcopy(model)
    wrapped = wrap(xs_model, inputs, {"cpu": plan.budgets["cpu"]}, plan=plan)
    runs = {"eager": (eager_model, eager_model), "xsched": (wrapped, xs_model)}
    opts = {k: torch.optim.SGD(params.parameters(), lr=1e-2) for k, (_, params) in runs.items()}
    losses: dict[str, list[float]] = {k: [] for k in runs}
    times: dict[str, list[float]] = {k: [] for k in runs}

    def step(k: str, seed: int) -> float:
        torch.manual_seed(seed)
        t0 = time.perf_counter()
        opts[k].zero_grad(set_to_none=True)
        loss = _loss(runs[k][0](*inputs))
        loss.backward()
        opts[k].step()
        losses[k].append(loss.item())
        return time.perf_counter() - t0

    warm = {k: warm_up(lambda k=k: step(k, len(losses[k])), warmup) for k in runs}
    for k in runs:  # the same number of steps on each side before the timed ones
        while len(losses[k]) < max(warm.values()):
            step(k, len(losses[k]))
    for _ in range(steps):
        for k in runs:
            times[k].append(step(k, len(losses[k])))
    same = all(abs(a - b) <= 1e-5 * max(1.0, abs(a)) for a, b in zip(losses["eager"], losses["xsched"]))
    same = same and all(
        torch.allclose(p, q, rtol=1e-5, atol=1e-6) for p, q in zip(eager_model.parameters(), xs_model.parameters())
    )
    return same, statistics.median(times["xsched"]) / statistics.median(times["eager"])
