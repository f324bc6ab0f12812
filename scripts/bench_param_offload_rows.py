"""The xsched rows of scripts/bench_gpu_param_offload.py and their per-step breakdown: `xsched train` with the
parameters on the host in fp32 (exactly the reference's arithmetic), in bf16 with fp32 master weights, the delayed
update and the optimizer split (the fast row), the eager bf16 reference that applies the same rules, and xsched alone
on a Llama of 3.2B parameters (tokens/s and the share of the GPU's bf16 dense rate); and the table of all rows."""

from __future__ import annotations

import re
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from plan_traffic import PREDICTED

from xsched.train.records import Quiet

BF16_DENSE_FLOPS = 790e12  # H100 SXM's measured bf16 dense matmul rate (the issue's figure)
BREAKDOWN = (  # (key in the step's breakdown, column)
    ("compute_s", "compute"),
    ("copy_in_s", "copies in"),
    ("copy_out_s", "copies out"),
    ("compute_idle_s", "compute idle"),
    ("compute_issue_s", "issue (host)"),
    ("compute_issue_cpu_s / compute_issue_s", "compute lane CPU / wall"),
    ("copy_in_issue_cpu_s / copy_in_issue_s", "copies in: lane CPU / wall"),
    ("copy_out_issue_cpu_s / copy_out_issue_s", "copies out: lane CPU / wall"),
    ("compute_switches / compute_preempted", "compute lane: context switches / preempted"),
    ("optimizer_s", "optimizer"),
    ("optimizer_wait_read_s", "wait opt (reads)"),
    ("optimizer_wait_step_s", "wait opt (loop)"),
)


def breakdown(records: list[Any]) -> dict[str, float]:
    """The median of each scalar of the steps' breakdowns, after two warm-up steps where there are four or more."""
    rows = [r.breakdown for r in records if r.breakdown is not None]
    rows = rows[2:] if len(rows) >= 4 else rows
    keys = [k for k, v in (rows[0].items() if rows else ()) if isinstance(v, float)]
    return {k: statistics.median(r[k] for r in rows) for k in keys}


class Started:
    """A reporter that keeps what the run reports at its start (its graph, plan and costs), nothing else."""

    def __init__(self) -> None:
        self.info: dict[str, Any] = {}

    def start(self, info: Any) -> None:
        self.info = dict(info)

    def step(self, record: Any) -> None: ...
    def checkpoint(self, step: int, path: Any) -> None: ...
    def notice(self, text: str) -> None: ...
    def end(self, result: Any) -> None: ...
    def close(self) -> None: ...


class SplitNotice(Quiet):
    """Quiet (notices to stderr) that keeps the optimizer split's notice, for the row's note."""

    text = ""

    def notice(self, text: str) -> None:
        if text.startswith("optimizer split"):
            self.text = text
        super().notice(text)

    def described(self, share: Any, by: str) -> str:
        """The split in a few words: a fixed share and how its parameters were picked, or the share auto chose
        and its predicted step with and without it."""
        if share != "auto":
            return f"split {share:g} by {by}"
        chosen = re.search(r"share (\S+) of", self.text)
        steps = re.search(r"predicted step (\S+) ms, (\S+) ms with nothing moved", self.text)
        if chosen is None or steps is None:
            return "split auto (no notice)"
        return f"split auto: share {chosen[1]}, predicted {steps[1]} ms a step ({steps[2]} ms with none)"


def offload_config(setup: dict[str, Any], model: str, scale: str, budget: str, **options: Any) -> Any:
    """The TrainConfig of `xsched train` of zoo `model` at `scale`: the parameters, gradients and AdamW on the store,
    `budget` on the device (what `xsched_run` trains, and what a run reusing its cached plan must ask for)."""
    from xsched.train import TrainConfig

    device, store = setup["device"], setup["store"]
    return TrainConfig(
        f"zoo:{model}",
        {device: budget, store: setup["host_budget"]},
        steps=setup["steps"],
        lr=1e-3,
        scale=scale,
        method=setup["method"],
        time_limit=setup["time_limit"],
        gap=setup.get("gap"),
        profile=setup["profile"],
        cache_dir=setup["cache_dir"],
        param_home=store,
        stores=(store,),
        **options,
    )


def xsched_run(
    setup: dict[str, Any], model: str, scale: str, budget: str, reporter: Any = None, **options: Any
) -> tuple[Any, dict[str, Any]]:
    """`xsched train` of zoo `model` at `scale` with the parameters on the store, `budget` on the device; the
    result and the row's common fields. `reporter`: what train reports to (default Quiet)."""
    from bench_gpu_param_offload import gib
    from plan_traffic import plan_traffic

    from xsched.contracts.plan import Plan
    from xsched.train import train
    from xsched.train.progress import Tee
    from xsched.train.records import Quiet, setup_text

    device = setup["device"]
    kept = None
    if setup.get("trace_dir"):  # the last step's lanes (host and GPU spans per task) and the plan they ran
        kept = Path(setup["trace_dir"]) / f"{model}-{budget}-{options.get('precision', 'fp32')}"
        kept.parent.mkdir(parents=True, exist_ok=True)
        options = {**options, "trace": f"{kept}.trace.json"}
    config = offload_config(setup, model, scale, budget, **options)
    t0 = time.perf_counter()
    started = Started()
    r = train(config, Tee(reporter if reporter is not None else Quiet(), started))
    plan = Plan.load(r.plan_path)
    if kept is not None:
        shutil.copyfile(r.plan_path, f"{kept}.plan.json")
    o = r.optimizer
    cuda = not setup["cpu"]
    steps = len(r.records)
    out = {
        "losses": r.losses,
        "step_s": [x.step_s for x in r.records],
        "optimizer_s": o.optimizer_s if o else None,
        "hidden_s": o.hidden_s if o else None,
        "gpu_peak": max(x.peak_bytes[device] for x in r.records) if cuda else None,
        "setup_s": r.setup_s,
        "breakdown": breakdown(list(r.records)),
        "setup_stages": dict(r.setup_stages),
        "predicted": plan_traffic(started.info["graph"], plan, started.info["profile"], device),
        "note": f"host AdamW: {started.info.get('host_share') or '-'}; plan {plan.solver.found_by} at {budget} on "
        f"{device} (predicted peak "
        f"{gib(plan.predicted.peak_bytes[device])}), setup {r.setup_s:.0f} s ({setup_text(r.setup_stages)}), "
        f"{(o.waited_s if o else 0) / max(steps, 1):.3f} s/step waited for the optimizer, "
        f"{time.perf_counter() - t0:.0f} s in all",
    }
    if cuda:
        out["allocators"] = allocator_counts(torch.device(device))
    return r, out


# what settles whether a run's copies synchronised in an allocator (issue 30: copies in at a fifth of the link rate)
DEVICE_COUNTS = ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_sync_all_streams")
HOST_COUNTS = ("num_host_alloc", "num_host_free", "host_alloc_time.total", "host_free_time.total")


def allocator_counts(dev: torch.device) -> dict[str, Any]:
    """The GPU caching allocator's retries (each frees the cache and synchronises) and its cudaMalloc/cudaFree calls,
    and the pinned host allocator's cudaHostAlloc/free calls and their time (us), over the whole run."""
    gpu = torch.cuda.memory_stats(dev)
    host = torch.cuda.host_memory_stats() if hasattr(torch.cuda, "host_memory_stats") else {}
    return {**{k: gpu.get(k) for k in DEVICE_COUNTS}, **{k: host.get(k) for k in HOST_COUNTS}}


def row_xsched(setup: dict[str, Any]) -> dict[str, Any]:
    """fp32, the parameters, gradients and AdamW on the host: the reference's arithmetic (losses compared)."""
    _, out = xsched_run(setup, "gpt2", setup["scale"], setup["budget"])
    return out


def row_xsched_allcores(setup: dict[str, Any]) -> dict[str, Any]:
    """row_xsched with the host AdamW at torch's thread count and priority, as before xsched.train.host_share (its
    default beside a GPU leaves the issuing threads their cores, at nice +10): the share's effect, in one run."""
    _, out = xsched_run(setup, "gpt2", setup["scale"], setup["budget"], host_threads="all", host_nice=0)
    return out


def row_xsched_one(setup: dict[str, Any]) -> dict[str, Any]:
    """row_xsched with every step issued by the training thread (`--issue one`), not a thread per lane."""
    _, out = xsched_run(setup, "gpt2", setup["scale"], setup["budget"], issue="one")
    gpu = setup["device"].startswith("cuda")  # one thread issues GPU streams; host lanes keep a thread each
    how = "issued by the training thread alone" if gpu else "--issue one, run on lanes: its lanes are host lanes"
    out["note"] = f"{how}; " + out["note"]
    return out


def row_xsched_fast(setup: dict[str, Any]) -> dict[str, Any]:
    """bf16 weights (fp32 master weights and AdamW state on the host, bf16 gradients over the link), the delayed
    update, and the optimizer of the first layers on the GPU (--optimizer-split)."""
    by = setup.get("split_by", "order")
    options = {"precision": "bf16", "delayed_update": True, "optimizer_split": setup["split"], "optimizer_split_by": by}
    split = SplitNotice()
    _, out = xsched_run(setup, "gpt2", setup["scale"], setup["budget"], split, **options)
    out["note"] = f"bf16 + fp32 master, delayed update, {split.described(setup['split'], by)}; " + out["note"]
    out["split_notice"] = split.text
    out["compare"] = "reference_bf16"
    return out


def row_reference_bf16(setup: dict[str, Any]) -> dict[str, Any]:
    """Eager PyTorch on the compute device: bf16 weights under autocast, fp32 master weights and fused AdamW there,
    each update written into the weights one step late (the delayed rule): what xsched_fast computes."""
    from bench_gpu_param_offload import LR, WEIGHT_DECAY, task_of, train_loop

    dev = torch.device("cpu" if setup["cpu"] else setup["device"])
    task = task_of(setup)
    model = task.model.to(dev).to(torch.bfloat16)
    params = list(model.parameters())
    master = [torch.nn.Parameter(p.detach().float().clone()) for p in params]
    groups = [
        {"params": [m for m in master if m.dim() >= 2], "weight_decay": WEIGHT_DECAY},
        {"params": [m for m in master if m.dim() < 2], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=LR, fused=True)
    state = {"step": 0}

    def forward(*inputs: Any) -> Any:
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            return model(*inputs)

    def backward(loss: torch.Tensor) -> None:
        model.zero_grad(set_to_none=True)
        loss.backward()

    @torch.no_grad()
    def step() -> None:
        if state["step"] > 0:
            torch._foreach_copy_(params, master)
        for p, m in zip(params, master):
            m.grad = p.grad.float()
        opt.step()
        state["step"] += 1

    out = train_loop(setup, task, dev, forward, backward, step)
    out["note"] = f"{dev.type}, bf16 weights, fp32 master + fused AdamW there, the delayed rule"
    out["compare"] = None  # bf16 and a step late: not the fp32 reference's losses, by design
    return out


def row_llama(setup: dict[str, Any]) -> dict[str, Any]:
    """xsched alone on a Llama of 3.2B parameters in bf16, master weights and AdamW on the host, delayed update:
    tokens/s and the share of the bf16 dense rate (6·N·tokens + 12·layers·width·seq·tokens FLOPs)."""
    from xsched import zoo

    scale = setup["llama_scale"]
    options = {"precision": "bf16", "delayed_update": True}
    share = setup.get("llama_split")
    if share:
        options["optimizer_split"] = share
    split = SplitNotice()
    r, out = xsched_run(setup, "llama", scale, setup["llama_budget"], split, **options)
    cfg = zoo.config("llama", scale)
    n = sum(p.numel() for p in zoo.build_module("llama", scale, device="meta").parameters())
    tokens = cfg.batch * cfg.seq
    flops = (6 * n + 12 * cfg.n_layer * cfg.n_embd * cfg.seq) * tokens
    steps = out["step_s"][2:] if len(out["step_s"]) >= 4 else out["step_s"]
    step = statistics.median(steps)
    out["tokens_per_s"] = tokens / step
    out["mfu"] = flops / step / BF16_DENSE_FLOPS
    out["params"] = n
    how = split.described(share, "order") if share else "no split"
    out["note"] = f"{n / 1e9:.2f}B parameters, {tokens} tokens/step, bf16 + fp32 master, delayed, {how}; " + out["note"]
    out["split_notice"] = split.text
    out["compare"] = None
    return out


def breakdown_cells(r: dict[str, Any]) -> list[str]:
    """The breakdown's columns in ms; "a / b" keys as two figures (a lane's thread CPU inside its tasks beside their
    wall: the rest of the wall is waiting, for the GIL, a lock or a blocking CUDA call)."""
    b = r.get("breakdown") or {}

    def cell(key: str) -> str:
        keys = key.split(" / ")
        if not all(k in b for k in keys):
            return "-"
        if not keys[0].endswith("_s"):  # counts
            return " / ".join(f"{b[k]:.0f}" for k in keys)
        return " / ".join(f"{b[k] * 1e3:.0f}" for k in keys) + " ms"

    return [cell(k) for k, _ in BREAKDOWN]


def predicted_cells(r: dict[str, Any]) -> list[str]:
    """The plan's prediction per step (plan_traffic): times in ms, bytes as gib() writes them; "-" for a row
    without a plan."""
    from bench_gpu_param_offload import gib

    p = r.get("predicted") or {}
    return ["-" if k not in p else gib(p[k]) if k.startswith("bytes") else f"{p[k] * 1e3:.1f} ms" for k, _ in PREDICTED]


HEADER = (
    "| row | step time | vs reference | GPU peak | host memory (peak RSS) | loss = reference | optimizer time "
    "| hidden behind the run | "
    + " | ".join(c for _, c in BREAKDOWN)
    + " | tokens/s | bf16 rate share | "
    + " | ".join(c for _, c in PREDICTED)
    + " | note |"
)
BF16_RTOL = 2e-2  # bf16: about 3 significant digits


def table(results: dict[str, dict[str, Any]], rtol: float, steps: int) -> list[str]:
    """The markdown table of every row (the reference's step time and losses are the yardstick)."""
    from bench_gpu_param_offload import gib, same_losses, steady

    ref = results.get("reference", {})
    ref_step = steady(ref["step_s"]) if "step_s" in ref else None
    width = HEADER.count("|") - 1
    lines = [HEADER, "|" + "---|" * width]
    for row, r in results.items():
        if "skipped" in r or "error" in r:
            why = (r.get("skipped") or f"error: {r['error']}").replace("|", "/")
            lines.append(f"| {row} | {why} |" + " |" * (width - 2))
            continue
        step = steady(r["step_s"])
        vs = f"{step / ref_step:.2f}x" if ref_step and row != "llama" else "-"
        opt = r.get("optimizer_s")
        hidden = "-" if not opt or r.get("hidden_s") is None else f"{r['hidden_s'] / opt:.0%}"
        against = r.get("compare", "reference")
        if row == "reference":
            same = "reference"
        elif against is None:
            same = "-"
        else:
            want = results.get(against, {}).get("losses")
            tol = BF16_RTOL if against == "reference_bf16" else rtol
            same = f"{against}: {same_losses(r['losses'], want, tol)}" if against != "reference" else None
            same = same or same_losses(r["losses"], want, tol)
        tps = f"{r['tokens_per_s']:.0f}" if r.get("tokens_per_s") else "-"
        mfu = f"{r['mfu']:.1%}" if r.get("mfu") else "-"
        cells = " | ".join(breakdown_cells(r))
        plan = " | ".join(predicted_cells(r))
        lines.append(
            f"| {row} | {step * 1e3:.1f} ms | {vs} | {gib(r.get('gpu_peak'))} | {gib(r.get('host_peak'))} | {same} "
            f"| {'-' if opt is None else f'{opt:.2f} s'} | {hidden} | {cells} | {tps} | {mfu} | {plan} "
            f"| {r.get('note', '')} |"
        )
    lines.append("")
    lines.append(
        f"{steps} steps per row. Step time: median after two warm-up steps (forward, backward, optimizer; xsched's "
        "step ends when its gradients are in, its updates finish while the next forward waits only for the weights "
        "it reads). GPU peak: max_memory_allocated over the steps. Loss = reference: every step's loss within "
        f"rtol {rtol:g} (bf16 rows: of reference_bf16, eager bf16 with fp32 master weights and the same delayed "
        f"rule, within {BF16_RTOL:g}). Optimizer time: all steps; hidden: the part inside the steps' forward and "
        "backward passes (HostAdamW's worker, measured), 0% where the step runs after the backward. Breakdown "
        "(xsched rows, median per step): compute, copies in and out (GPU time from CUDA events; host time on the "
        "CPU), the compute lanes' idle time inside the runs, the host time spent issuing the compute, each lane "
        "kind's thread CPU inside its tasks beside their wall (the rest is waiting: the GIL, locks, blocking CUDA "
        "calls), the compute lane thread's context switches a step and those the machine forced (each other one is "
        "a wait: for a lane, the GIL or a blocking call; Linux), the "
        "optimizer's busy time, and the time the reads and the loop waited for it. bf16 rate share: (6·N + "
        "12·layers·width·seq)·tokens FLOPs per second over 790 TFLOP/s. Predicted (xsched rows): what the plan the row "
        "trained predicts per step on the costs it was planned on (the simulator's makespan; the compute device's "
        "compute, the idle rest of the makespan, and the copies into and out of it: their bytes and modelled time), "
        "beside the measured columns; the JSON adds forward/backward and the copies' counts, and setup_stages (the "
        "seconds of each stage of the setup)."
    )
    return lines
