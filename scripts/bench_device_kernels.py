"""The attention stand-in (xsched/contracts/neutral_attention.py) against the CPU's fused kernel it replaces off
the CPU, on the CPU: time and peak memory of the forward and the backward for one attention shape (GPT-2 small's
by default: batch 8, 12 heads, 1024 tokens, head dim 64, causal), and the largest difference in their results.

    python scripts/bench_device_kernels.py                          # B8 H12 T1024 E64, float32, causal
    python scripts/bench_device_kernels.py --batch 1 --heads 2 --tokens 64 --head-dim 16 --reps 2   # the test's size

Each (implementation, phase) runs in a fresh child process, so one's freed memory is not the next one's: the peak
is the child's resident-memory high-water mark (VmHWM, reset through /proc/self/clear_refs just before the first
call) above its resident memory then, less the call's returned tensors: the transient, the kernel's own C++
scratch included. The stand-in's is also counted by xsched's LiveBytes (storages its aten ops make), which sees
no scratch inside a kernel and so does not apply to the fused one. Times are the median and best of `--reps`
calls after that first one, on `--threads` torch threads; on a shared machine read the ratio, not the seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
MiB = 1 << 20


def inputs(a: argparse.Namespace) -> tuple[torch.Tensor, ...]:
    """q, k, v as the CPU capture sees them (transposed views of (B, T, H, E) projections) and an output grad."""
    g = torch.Generator().manual_seed(0)
    dt = getattr(torch, a.dtype)
    shape = (a.batch, a.tokens, a.heads, a.head_dim)
    q, k, v, grad = (torch.randn(shape, generator=g).to(dt).transpose(1, 2) for _ in range(4))
    return q, k, v, grad


def _status(key: str) -> int:
    """A /proc/self/status figure in bytes (VmRSS, VmHWM)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {key} in /proc/self/status")


def child(a: argparse.Namespace) -> dict:
    """One (implementation, phase): its first call's transient, then its times; printed as JSON."""
    from xsched.contracts.neutral_attention import attention_backward, attention_forward
    from xsched.execute.live_bytes import LiveBytes

    torch.set_num_threads(a.threads)
    aten = torch.ops.aten
    q, k, v, grad = inputs(a)
    fwd = aten._scaled_dot_product_flash_attention_for_cpu.default
    bwd = aten._scaled_dot_product_flash_attention_for_cpu_backward.default
    out, lse = fwd(q, k, v, 0.0, a.causal)  # the backward's inputs, made before the measured call
    block = a.block_mib * MiB
    calls = {
        ("kernel", "forward"): lambda: fwd(q, k, v, 0.0, a.causal),
        ("stand-in", "forward"): lambda: attention_forward(q, k, v, 0.0, a.causal, block_bytes=block),
        ("kernel", "backward"): lambda: bwd(grad, q, k, v, out, lse, 0.0, a.causal),
        ("stand-in", "backward"): lambda: attention_backward(grad, q, k, v, out, lse, 0.0, a.causal, block_bytes=block),
    }
    call = calls[(a.impl, a.phase)]
    small = argparse.Namespace(**{**vars(a), "batch": 1, "heads": 1, "tokens": 8})
    sq, sk, sv, sg = inputs(small)  # first calls at a tiny size: code paged in and kernels picked, not counted
    so, sl = attention_forward(sq, sk, sv, 0.0, a.causal)
    attention_backward(sg, sq, sk, sv, so, sl, 0.0, a.causal)
    bwd(sg, sq, sk, sv, *fwd(sq, sk, sv, 0.0, a.causal), 0.0, a.causal)
    del sq, sk, sv, sg, so, sl
    Path("/proc/self/clear_refs").write_text("5")  # the high-water mark starts from here
    base = _status("VmRSS")
    result = call()
    peak = _status("VmHWM") - base - sum(t.untyped_storage().nbytes() for t in result)
    live = None
    if a.impl == "stand-in":
        with LiveBytes() as count:
            for t in (q, k, v, grad, out, lse):  # there before the call: counted from the start, not as made
                count.track(t)
            count.reset_peak()
            before = count.used["?"]
            again = call()
        live = count.peak["?"] - before - sum(t.untyped_storage().nbytes() for t in again)
        del again
    times = []
    for _ in range(a.reps):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    other = calls[("kernel" if a.impl == "stand-in" else "stand-in", a.phase)]()
    diff = max((x.float() - y.float()).abs().max().item() for x, y in zip(result, other))
    return {"peak": peak, "live": live, "median": statistics.median(times), "best": min(times), "diff": diff}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--block-mib", type=int, default=64, help="the stand-in's score block (BLOCK_BYTES: 64)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--threads", type=int, default=1, help="torch threads (1: steady beside other processes)")
    p.add_argument("--impl", choices=["kernel", "stand-in"], help=argparse.SUPPRESS)  # the child's
    p.add_argument("--phase", choices=["forward", "backward"], help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.impl:
        print(json.dumps(child(a)))
        return 0
    args = list(argv if argv is not None else sys.argv[1:])
    whole = a.batch * a.heads * a.tokens * a.tokens * 4
    print(
        f"attention B{a.batch} H{a.heads} T{a.tokens} E{a.head_dim} {a.dtype} causal={a.causal}, "
        f"{a.threads} threads, torch {torch.__version__}; the whole float32 score tensor is {whole / MiB:,.1f} MiB, "
        f"the stand-in's block {a.block_mib} MiB"
    )
    print(
        "| phase | implementation | median s | best s | time vs kernel | peak transient MiB | LiveBytes MiB "
        "| max abs diff |"
    )
    print("|---|---|---|---|---|---|---|---|")
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    for phase in ("forward", "backward"):
        rows = {}
        for impl in ("kernel", "stand-in"):
            cmd = [sys.executable, __file__, *args, "--impl", impl, "--phase", phase]
            run = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
            if run.returncode != 0:
                print(run.stderr[-3000:], file=sys.stderr)
                return run.returncode
            rows[impl] = json.loads(run.stdout.strip().splitlines()[-1])
        for impl, r in rows.items():
            live = "-" if r["live"] is None else f"{r['live'] / MiB:,.1f}"
            print(
                f"| {phase} | {impl} | {r['median']:.4f} | {r['best']:.4f} | "
                f"{r['median'] / rows['kernel']['median']:.2f}x | {r['peak'] / MiB:,.1f} | {live} | {r['diff']:.1e} |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
