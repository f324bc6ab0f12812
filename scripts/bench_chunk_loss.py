"""The chunked cross-entropy (xsched.capture.chunk_loss) on GPT-2 (6 layers, batch 8, T1024): the memory lower bound
and the eager peak of the captured graph before and after, and `auto` plans with the host as a store on modelled
H100 costs (the sim plugin's measured spec) at budgets in % of the *original* graph's eager peak. Nothing runs on a
GPU: capture is on fake tensors, costs are the roofline of devices/h100-measured.toml.

    python scripts/bench_chunk_loss.py                       # bounds only (seconds)
    python scripts/bench_chunk_loss.py --budgets 25,35 --time-limit 30
    python scripts/bench_chunk_loss.py --grad-outputs auto --budgets 25,35 --time-limit 30
    python scripts/bench_chunk_loss.py --grad-outputs auto --held --budgets 25,35 --time-limit 30
    python scripts/bench_chunk_loss.py --scale full --precision bf16 --grad-outputs auto   # issue 31's bf16 bound
    python scripts/bench_chunk_loss.py --scale full --precision bf16 --grad-outputs auto --weight-grad-sum float32
    python scripts/bench_chunk_loss.py --loss-only --budgets 25,35 --time-limit 30         # the logits chunked too
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import torch
from torch import nn

from xsched import zoo
from xsched.capture.chunk_loss import WEIGHT_GRAD_SUMS, chunk_cross_entropy
from xsched.capture.torch import capture
from xsched.contracts.graph import Graph
from xsched.contracts.plan import Compute, Copy
from xsched.contracts.profile import Profile
from xsched.errors import XschedError
from xsched.profiling.measure import profile_graph
from xsched.simulate import simulate
from xsched.solve import SolverOptions, eager_peak, eager_plan, solve
from xsched.solve.autograd_boundary import forward_outputs
from xsched.solve.bounds.memory import lower_bounds
from xsched.train.optim import autocast

GIB = 2**30
STORE = "cpu"
SPEC = "h100-measured"


class LossOnly(nn.Module):
    """The model's loss alone, as a Hugging Face model trained on its own loss returns it: the logits are no output
    (and the chunking makes them in blocks too)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        return self.model(*inputs)[1]


def graphs(a: argparse.Namespace) -> dict[int, Graph]:
    """0 -> the captured graph; K -> it with its loss in K chunks."""
    z = zoo.build("gpt2", batch=a.batch, scale=a.scale)
    model = LossOnly(z.model) if a.loss_only else z.model
    with autocast(a.precision, ("cuda",)):  # as `xsched train` captures for a GPU (its dropout and dtypes too)
        g = capture(model, z.inputs, grad_outputs=a.grad_outputs, device_type=a.device_type)
    if a.held:  # as `wrap` plans it: the caller holds the logits from the autograd boundary to the end
        g = dataclasses.replace(g, held_outputs=tuple(v for v in forward_outputs(g) if g.value[v].shape != ()))
    return {0: g, **{k: chunk_cross_entropy(g, k, a.weight_grad_sum) for k in (int(x) for x in a.chunks.split(","))}}


def label(k: int) -> str:
    return "original" if k == 0 else f"{k} chunks"


def bounds_table(gs: dict[int, Graph]) -> None:
    base = eager_peak(gs[0])
    print(
        "\n| graph | ops | eager peak GiB (% of original) | lower bound GiB (% of original eager) | set by "
        f"| eager step ms (sim:{SPEC}) |"
    )
    print("|---|---|---|---|---|---|")
    for k, g in gs.items():
        peak = eager_peak(g)
        b = lower_bounds(g, None, ["cuda:0"], {v: "cuda:0" for v in g.inputs})["cuda:0"]
        op = g.op[b.op].target.split(".")[1] if b.op else "homed inputs"
        prof = profile_graph(g, [f"sim:{SPEC}"], progress=False)
        step = simulate(g, eager_plan(g, f"sim:{SPEC}", prof), prof).makespan_s
        print(
            f"| {label(k)} | {len(g.ops)} | {peak / GIB:.2f} ({peak / base:.0%}) | {b.bytes / GIB:.2f} "
            f"({b.bytes / base:.1%}) | {b.by}: {op} | {step * 1e3:.1f} |",
            flush=True,
        )


def plan_row(g: Graph, prof: Profile, budget: int, limit: float, eager_s: float) -> str:
    """One `auto` plan with the store: makespan vs the original's eager step, its GPU peak, what it does."""
    dev = next(d for d in prof.devices if d != STORE)
    t0 = time.perf_counter()
    try:
        plan = solve(g, prof, {dev: budget, STORE: 1 << 40}, [dev, STORE], options=SolverOptions(time_limit_s=limit))
    except XschedError as e:
        return f"no plan: {e.detail[:150]} | | | {time.perf_counter() - t0:.0f}"
    sim = simulate(g, plan, prof)
    recomputes = sum(isinstance(s, Compute) for s in plan.steps) - len(g.ops)
    copies = sum(isinstance(s, Copy) for s in plan.steps)
    return (
        f"{sim.makespan_s / eager_s:.3f}x | {sim.peak_bytes[dev] / GIB:.2f} | {recomputes} / {copies} / "
        f"{sim.copy_bytes / GIB:.1f} | {time.perf_counter() - t0:.0f}"
    )


def plans_table(gs: dict[int, Graph], a: argparse.Namespace) -> None:
    base = eager_peak(gs[0])
    prof = profile_graph(gs[0], [f"sim:{SPEC}"], progress=False)
    dev = next(iter(prof.devices))
    eager_s = simulate(gs[0], eager_plan(gs[0], dev, prof), prof).makespan_s
    print(f"\noriginal eager step on sim:{SPEC}: {eager_s * 1e3:.1f} ms (modelled); eager peak {base / GIB:.2f} GiB")
    print("\n| budget | graph | makespan vs eager | GPU peak GiB | recomputes / copies / GiB moved | solve s |")
    print("|---|---|---|---|---|---|")
    planned = {k: g for k, g in gs.items() if k == 0 or str(k) in a.plan_chunks.split(",")}
    profs = {k: profile_graph(g, [f"sim:{SPEC}"], stores=[STORE], progress=False) for k, g in planned.items()}
    for pct in (int(x) for x in a.budgets.split(",")):
        for k, g in planned.items():
            row = plan_row(g, profs[k], base * pct // 100, a.time_limit, eager_s)
            print(f"| {pct}% ({base * pct / 100 / GIB:.2f} GiB) | {label(k)} | {row} |", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scale", default="full:n_layer=6")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--grad-outputs", default="all", choices=["all", "auto"])
    ap.add_argument("--precision", default="fp32", choices=["fp32", "bf16"], help="bf16: xsched train's autocast")
    ap.add_argument("--loss-only", action="store_true", help="the model returns its loss alone (no logits output)")
    ap.add_argument("--held", action="store_true", help="the logits held by the caller, as `wrap` plans it")
    ap.add_argument(
        "--device-type", default="cuda", choices=["cuda", "cpu"], help="the kernels the graph is captured for"
    )
    ap.add_argument("--chunks", default="4,8,16", help="chunk counts to compare with the original")
    ap.add_argument("--weight-grad-sum", default="per_chunk", choices=WEIGHT_GRAD_SUMS, help="a bf16 dW's sum")
    ap.add_argument("--budgets", default="", help="GPU budgets in %% of the original eager peak (plans; slow)")
    ap.add_argument("--plan-chunks", default="4,8,16", help="chunk counts planned at each budget")
    ap.add_argument("--time-limit", type=float, default=30.0, help="auto's limit per plan, seconds")
    a = ap.parse_args(argv)
    t0 = time.perf_counter()
    gs = graphs(a)
    print(
        f"GPT-2 {a.scale} batch {a.batch}, {a.precision}, grad_outputs {a.grad_outputs}"
        + (", logits held" if a.held else "")
        + (", loss alone" if a.loss_only else "")
        + (f", weight gradient summed {a.weight_grad_sum}" if a.precision != "fp32" else "")
        + f": captured in {time.perf_counter() - t0:.1f} s"
    )
    bounds_table(gs)
    if a.budgets:
        plans_table(gs, a)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
