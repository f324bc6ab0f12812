"""Training in bf16 as people do (issue 26): GPT-2 (zoo, full: 124M parameters, sequence 1024) trained with bf16
autocast and AdamW by plain PyTorch, by PyTorch with torch.utils.checkpoint around every block, and by `xsched
train --precision bf16` at 60% of the eager peak and at the checkpoint row's measured peak (equal memory).

python scripts/bench_gpu_train_bf16.py --out docs/bench/gpu_train_bf16.md   # an H100/H200: under 5 minutes
python scripts/bench_gpu_train_bf16.py --cpu --steps 3                      # reduced: GPT-2 small on the CPU

Each row runs in a process of its own (its GPU peak its own) and trains the same initial weights on the same
batches with the same AdamW (lr 1e-3, weight decay 0.01 on 2+-D weights). Columns: the step time against eager
bf16, the GPU peak (max_memory_allocated over the steps: weights, gradients and AdamW's states included) against
eager's, and whether every step's loss is eager's within bf16's tolerance.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
from bench_gpu_param_offload import (
    LR,
    backward_with,
    gib,
    groups,
    same_losses,
    steady,
    task_of,
    train_loop,
)
from bench_gpu_torch_rows import checkpointed_blocks
from bench_rows_runner import publish, run_child, run_rows

ROWS = ("eager", "checkpoint", "xsched", "xsched_equal")
GPU = {"scale": "full:dropout=0.0", "device": "cuda:0", "budget": "60%"}
CPU = {"scale": "small:dropout=0.0", "device": "cpu", "budget": "60%"}  # modelled costs: seconds to plan


# ---- the rows (each in a child process) ----
def torch_row(setup: dict[str, Any], checkpointed: bool) -> dict[str, Any]:
    """Plain PyTorch under bf16 autocast (forward and loss), torch's AdamW after the backward."""
    dev = torch.device(setup["device"])
    task = task_of(setup)
    model = task.model.to(dev)
    opt = torch.optim.AdamW(groups(model.parameters()), lr=LR)

    def forward(*inputs: Any) -> Any:
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            return model(*inputs)

    with checkpointed_blocks(model) if checkpointed else contextlib.nullcontext():
        out = train_loop(setup, task, dev, forward, backward_with(opt), opt.step)
    out["note"] = "torch.utils.checkpoint around every block" if checkpointed else "bf16 autocast"
    return out


def row_eager(setup: dict[str, Any]) -> dict[str, Any]:
    return torch_row(setup, checkpointed=False)


def row_checkpoint(setup: dict[str, Any]) -> dict[str, Any]:
    return torch_row(setup, checkpointed=True)


def row_xsched(setup: dict[str, Any]) -> dict[str, Any]:
    """`xsched train --precision bf16` at `setup["budget"]` on the device (the profile measured within its cap)."""
    from xsched.contracts.plan import Compute, Plan
    from xsched.train import TrainConfig, train
    from xsched.train.records import Quiet

    device, cache = setup["device"], setup["cache_dir"]
    profile = "model" if setup["cpu"] else _profile_capped(setup, cache)
    config = TrainConfig(
        "zoo:gpt2",
        {device: setup["budget"]},
        steps=setup["steps"],
        lr=LR,
        scale=setup["scale"],
        time_limit=setup["time_limit"],
        profile=profile,
        cache_dir=cache,
        precision="bf16",
    )
    r = train(config, Quiet())
    plan = Plan.load(r.plan_path)
    ops = [s.op for s in plan.steps if isinstance(s, Compute)]
    return {
        "losses": r.losses,
        "step_s": [x.step_s for x in r.records],
        "gpu_peak": max(x.peak_bytes[device] for x in r.records) if not setup["cpu"] else None,
        "note": f"plan {plan.solver.found_by} at {setup['budget']} (predicted peak "
        f"{gib(plan.predicted.peak_bytes[device])}, {len(ops) - len(set(ops))} recomputes), "
        f"setup {r.setup_s:.0f} s",
    }


def row_xsched_equal(setup: dict[str, Any]) -> dict[str, Any]:
    """xsched at the checkpoint row's measured peak, less AdamW's two fp32 states (the plan does not hold them)."""
    return row_xsched({**setup, "budget": setup["equal_budget"]})


def _profile_capped(setup: dict[str, Any], cache: str) -> str:
    """Measure the profile within --profile-s and store it where `xsched train` looks for it: the graph captured
    as train captures it (bf16 autocast, the same name). Returns the profile mode for TrainConfig."""
    from xsched.capture.torch import capture
    from xsched.devices.spec import target_device_type
    from xsched.execute.back_to_back import profile_calibrated
    from xsched.pipeline import profile_path
    from xsched.profiling.store import save_profile
    from xsched.train.optim import autocast
    from xsched.train.plan_wrap import grad_outputs

    task = task_of(setup)
    with autocast("bf16", ("cuda",)):
        graph = capture(
            task.model,
            task.example_batch[0],
            name="gpt2",
            grad_outputs=grad_outputs(task),
            device_type=target_device_type([setup["device"]]),  # typed for the device, as train types it
        )
    path = profile_path(graph, [setup["device"]], cache)
    if not path.exists():
        measured = profile_calibrated(graph, [setup["device"]], max_total_s=setup["profile_s"], progress=False)
        save_profile(measured, path)  # calibrated back to back, as `xsched train` would measure it
    return "measure"


# ---- the parent ----
def table(results: dict[str, dict[str, Any]], rtol: float, steps: int) -> list[str]:
    ref = results.get("eager", {})
    ref_step = steady(ref["step_s"]) if "step_s" in ref else None
    ref_peak = ref.get("gpu_peak")
    lines = [
        "| row | step time | vs eager | GPU peak | vs eager | loss = eager | note |",
        "|---|---|---|---|---|---|---|",
    ]
    for row, r in results.items():
        if "error" in r or "skipped" in r:
            why = (r.get("skipped") or f"error: {r['error']}").replace("|", "/")
            lines.append(f"| {row} | {why} | | | | | |")
            continue
        step, peak = steady(r["step_s"]), r.get("gpu_peak")
        vs = f"{step / ref_step:.2f}x" if ref_step else "-"
        vs_peak = f"{peak / ref_peak:.0%}" if peak and ref_peak else "-"
        same = "reference" if row == "eager" else same_losses(r["losses"], ref.get("losses"), rtol)
        lines.append(f"| {row} | {step * 1e3:.1f} ms | {vs} | {gib(peak)} | {vs_peak} | {same} | {r.get('note', '')} |")
    lines += [
        "",
        f"{steps} steps per row. Step time: median after two warm-up steps (forward, backward, AdamW). GPU peak: "
        "max_memory_allocated over the steps, weights, gradients and AdamW's states included. Loss = eager: every "
        f"step's loss within rtol {rtol:g} of eager bf16's.",
    ]
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu", action="store_true", help="the reduced mode: small GPT-2 on the CPU, modelled costs")
    ap.add_argument("--scale", help="zoo gpt2 scale (default full:dropout=0.0 on a GPU, small:dropout=0.0 on the CPU)")
    ap.add_argument("--budget", help="xsched's budget (default 60%% of the eager peak)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, of {', '.join(ROWS)}")
    ap.add_argument("--time-limit", type=float, default=30.0, help="xsched's solver time limit, seconds")
    ap.add_argument("--profile-s", type=float, default=40.0, help="cap on xsched's GPU profiling, seconds")
    ap.add_argument("--row-timeout", type=float, default=200.0, help="seconds per row before it is stopped")
    ap.add_argument("--loss-rtol", type=float, default=2e-2, help="bf16: about 3 significant digits")
    ap.add_argument("--out", help="also write the markdown table here")
    ap.add_argument("--child", choices=ROWS, help=argparse.SUPPRESS)
    ap.add_argument("--setup", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        rows = {r: globals()[f"row_{r}"] for r in ROWS}
        return run_child(a.child, json.loads(a.setup), Path(a.result), rows)
    if not a.cpu and not torch.cuda.is_available():
        print("no CUDA GPU: run with --cpu for the reduced mode", file=sys.stderr)
        return 2
    setup = {**(CPU if a.cpu else GPU), "cpu": a.cpu, "steps": a.steps, "time_limit": a.time_limit}
    setup.update(profile_s=a.profile_s, **{k: v for k, v in (("scale", a.scale), ("budget", a.budget)) if v})
    t0 = time.perf_counter()
    results = run_rows(a.rows.split(","), setup, a.row_timeout, __file__, _equal_budget)
    title = f"bf16 training: GPT-2 {setup['scale']}, eager against checkpointing and xsched"
    where = f"xsched at {setup['budget']} on {setup['device']}"
    return publish(title, where, __file__, argv, a, t0, results, table(results, a.loss_rtol, a.steps))


def _equal_budget(row: str, setup: dict[str, Any], results: dict[str, dict[str, Any]]) -> str | None:
    """Before the xsched_equal row: its budget, the checkpoint row's measured peak less AdamW's two fp32 states;
    or why it cannot run."""
    if row != "xsched_equal":
        return None
    peak = results.get("checkpoint", {}).get("gpu_peak")
    if not peak:
        return "needs the checkpoint row's measured GPU peak (a GPU)"
    setup["equal_budget"] = str(peak - 2 * _param_bytes(setup))
    return None


def _param_bytes(setup: dict[str, Any]) -> int:
    return sum(p.numel() * p.element_size() for p in task_of(setup).model.parameters())


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main())
