"""Hugging Face models at 50% of their eager peak: `xsched.wrap` against eager PyTorch and against transformers'
own activation checkpointing (torch.utils.checkpoint per layer), for GPT-2, a grouped-query Llama and BERT (masked
LM), SDPA attention (the default), training step = zero_grad + forward + backward.

    python scripts/bench_hf.py                      # the CPU table of docs/BENCHMARKS.md §14
    python scripts/bench_hf.py --device cuda --profile-cap 6 --time-limit 4 --deadline 60   # one GPU, larger sizes
    python scripts/bench_hf.py --quick              # tiny sizes, modelled costs: a smoke test

Times are medians of interleaved steps measured in this one run (the three variants share the machine's load), so
compare the ratios. Each model's first wrapped step is checked against eager (loss and gradients) before timing:
the plan runs the real kernels, so SDPA's non-contiguous outputs (flash or memory-efficient attention on a GPU)
must reach the ops after it as eager lays them out. Memory: on a GPU the measured peak (max_memory_allocated over
one step) of each variant; on the CPU the plan's predicted peak against its budget."""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from xsched.budgets import format_bytes  # noqa: E402
from xsched.execute.back_to_back import profile_calibrated  # noqa: E402
from xsched.execute.wrap import wrap  # noqa: E402
from xsched.train.hf import OwnLoss  # noqa: E402

SIZES = {  # per mode: layers, hidden, heads, key/value heads (llama), vocab, sequence, batch
    "quick": dict(layers=2, hidden=64, heads=2, kv=1, vocab=128, seq=64, batch=4),
    "cpu": dict(layers=4, hidden=256, heads=4, kv=2, vocab=2048, seq=256, batch=4),
    "cuda": dict(layers=6, hidden=768, heads=12, kv=4, vocab=8192, seq=1024, batch=8),
}
MODELS = ("gpt2", "llama", "bert")


def build(name: str, s: dict) -> nn.Module:
    import transformers

    transformers.logging.set_verbosity_error()
    if name == "gpt2":
        config = transformers.GPT2Config(
            n_layer=s["layers"], n_embd=s["hidden"], n_head=s["heads"], vocab_size=s["vocab"], n_positions=s["seq"]
        )
        kind = transformers.GPT2LMHeadModel
    elif name == "llama":
        config = transformers.LlamaConfig(
            num_hidden_layers=s["layers"],
            hidden_size=s["hidden"],
            intermediate_size=int(2.75 * s["hidden"]),
            num_attention_heads=s["heads"],
            num_key_value_heads=s["kv"],
            vocab_size=s["vocab"],
            max_position_embeddings=s["seq"],
        )
        kind = transformers.LlamaForCausalLM
    else:
        config = transformers.BertConfig(
            num_hidden_layers=s["layers"],
            hidden_size=s["hidden"],
            intermediate_size=4 * s["hidden"],
            num_attention_heads=s["heads"],
            vocab_size=s["vocab"],
            max_position_embeddings=s["seq"],
        )
        kind = transformers.BertForMaskedLM
    config.use_cache = False
    return kind._from_config(config, attn_implementation="sdpa").train()


def batch(name: str, s: dict, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, s["vocab"], (s["batch"], s["seq"]), generator=g)
    labels = ids.clone()
    if name == "bert":  # a masked LM: 15% of the positions masked and predicted, the rest ignored
        masked = torch.rand(ids.shape, generator=g) < 0.15
        labels = torch.where(masked, ids, torch.full_like(ids, -100))
        ids = torch.where(masked, torch.zeros_like(ids), ids)
    return ids.to(device), labels.to(device)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def step(call: nn.Module, params: list[nn.Parameter], inputs: tuple) -> torch.Tensor:
    for p in params:
        p.grad = None
    loss = call(*inputs)
    loss.backward()
    return loss.detach()


def check(wrapped: nn.Module, eager: nn.Module, inputs: tuple) -> tuple[float, float]:
    """Max |loss difference| and max |gradient difference| of one step, wrapped against eager (dropout off)."""
    torch.manual_seed(1)
    a = step(wrapped, list(wrapped.parameters()), inputs)
    torch.manual_seed(1)
    b = step(eager, list(eager.parameters()), inputs)
    grads = [
        (p.grad - q.grad).abs().max().item()
        for p, q in zip(wrapped.parameters(), eager.parameters())
        if p.grad is not None
    ]
    return (a - b).abs().item(), max(grads)


def timed(device: torch.device, fn: Callable[[], object]) -> tuple[float, int]:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    sync(device)
    t = time.perf_counter()
    fn()
    sync(device)
    dt = time.perf_counter() - t
    peak = torch.cuda.max_memory_allocated(device) - base if device.type == "cuda" else 0
    return dt, peak


def bench(name: str, s: dict, device: torch.device, a: argparse.Namespace) -> dict:
    torch.manual_seed(0)
    model = build(name, s)
    for m in model.modules():  # dropout off: the check compares one step's numbers, not dropout masks
        if isinstance(m, nn.Dropout):
            m.p = 0.0
    model.config.attention_probs_dropout_prob = model.config.attention_dropout = 0.0
    model.to(device)  # captured on the device: the graph has the device's own attention kernels
    eager = OwnLoss(model)
    ckpt_model = copy.deepcopy(model)
    if hasattr(ckpt_model, "activation_checkpointing_enable"):  # transformers 5's name for it
        ckpt_model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        ckpt_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ckpt = OwnLoss(ckpt_model)
    mine = OwnLoss(copy.deepcopy(model))
    inputs = batch(name, s, device)
    dev = "cuda:0" if device.type == "cuda" else "cpu"
    t0 = time.perf_counter()
    if a.quick:
        profile = "model"
    else:  # measured op costs within a cap (wrap's own "measure" has none)
        from xsched.capture.torch import capture

        graph = capture(mine, inputs, name=f"bench-hf-{name}")
        profile = profile_calibrated(graph, [dev], max_total_s=a.profile_cap, progress=False)
    wrapped = wrap(mine, inputs, {dev: f"{a.budget}%"}, method=a.method, time_limit=a.time_limit, profile=profile)
    plan_s = time.perf_counter() - t0
    loss_diff, grad_diff = check(wrapped, eager, inputs)
    rows = {"eager": (eager, model), "checkpointing": (ckpt, ckpt_model), "xsched": (wrapped, mine)}
    times: dict[str, list[float]] = {k: [] for k in rows}
    peaks: dict[str, int] = {k: 0 for k in rows}
    for _ in range(a.warmup):
        for call, m in rows.values():
            step(call, list(m.parameters()), inputs)
    for _ in range(a.steps):  # interleaved: each variant once per round
        for k, (call, m) in rows.items():
            dt, peak = timed(device, lambda call=call, m=m: step(call, list(m.parameters()), inputs))
            times[k].append(dt)
            peaks[k] = max(peaks[k], peak)
    med = {k: statistics.median(v) for k, v in times.items()}
    plan = wrapped.plan
    return {
        "model": name,
        "ops": len(wrapped.graph.ops),
        "eager_s": med["eager"],
        "ckpt_ratio": med["checkpointing"] / med["eager"],
        "xsched_ratio": med["xsched"] / med["eager"],
        "xsched_vs_ckpt": med["xsched"] / med["checkpointing"],
        "budget": plan.budgets[dev],
        "predicted_peak": wrapped.report().split(f"{dev}: peak ")[1].split(" of")[0],
        "peaks": peaks,
        "plan_s": plan_s,
        "found_by": plan.solver.found_by,
        "loss_diff": loss_diff,
        "grad_diff": grad_diff,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--quick", action="store_true", help="tiny sizes and modelled costs (a smoke test)")
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--budget", type=float, default=50.0, help="percent of the eager peak (default 50)")
    p.add_argument("--steps", type=int, default=5, help="timed steps per variant (interleaved)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--method", default="auto")
    p.add_argument("--time-limit", type=float, default=5.0, help="solver time limit per model, seconds")
    p.add_argument("--profile-cap", type=float, default=8.0, help="profiling cap per model, seconds")
    p.add_argument("--deadline", type=float, help="skip the models left after this many seconds")
    a = p.parse_args(argv)
    device = torch.device("cuda:0" if a.device == "cuda" else "cpu")
    if device.type == "cuda" and not torch.cuda.is_available():
        print("--device cuda: no CUDA device here", file=sys.stderr)
        return 2
    sizes = SIZES["quick" if a.quick else a.device]
    print(f"# bench_hf: {a.device}, {a.budget:g}% of the eager peak, sizes {sizes}, torch {torch.__version__}")
    gpu = device.type == "cuda"
    head = "| model | ops | eager step | checkpointing / eager | xsched / eager | xsched / checkpointing | "
    head += "peak eager / ckpt / xsched (measured) |" if gpu else "xsched predicted peak / budget |"
    print(head + " plan (s, found by) | check: max loss / grad diff |")
    print("|" + "---|" * 9)
    t = time.perf_counter()
    failed = False
    for name in a.models.split(","):
        if a.deadline is not None and time.perf_counter() - t > a.deadline:
            print(f"| {name} | skipped: past the --deadline of {a.deadline:g} s |")
            continue
        try:
            r = bench(name, sizes, device, a)
        except Exception as e:  # one model failing (an XschedError, out of memory) must not lose the other rows
            print(f"| {name} | error: {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''} |")
            failed = True
            continue
        mem = (
            " / ".join(format_bytes(r["peaks"][k]) for k in ("eager", "checkpointing", "xsched"))
            if gpu
            else f"{r['predicted_peak']} / {format_bytes(r['budget'])}"
        )
        print(
            f"| {name} | {r['ops']} | {r['eager_s'] * 1e3:.1f} ms | {r['ckpt_ratio']:.2f} | {r['xsched_ratio']:.2f} | "
            f"{r['xsched_vs_ckpt']:.2f} | {mem} | {r['plan_s']:.1f} s, {r['found_by']} | "
            f"{r['loss_diff']:.1e} / {r['grad_diff']:.1e} |",
            flush=True,
        )
    print(f"# total {time.perf_counter() - t:.1f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
