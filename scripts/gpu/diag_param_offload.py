"""Where a `--param-home` step's time goes on a GPU: `xsched train` on a GPT-2 under torch.profiler, summarised.

python scripts/gpu/diag_param_offload.py --out DIR                       # a GPU: GPT-2 12 layers, n_embd 1600
python scripts/gpu/diag_param_offload.py --cpu --out DIR                 # reduced: cpu:0 computes, cpu:1 stores

Prints the step records (step time, optimizer time, hidden, waited), then from the profiled steps: the GPU's busy
time by kind (kernels, copies to and from the host, device copies) and its idle share, the host threads' busiest
ops, and writes the Chrome trace (gzip) under --out.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import shutil
import sys
import tempfile
from pathlib import Path

from torch.profiler import ProfilerActivity, profile, schedule

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

GPU = dict(
    scale="full:n_layer=12,n_head=25,n_embd=1600,seq=512,batch=2,dropout=0.0",
    device="cuda:0",
    budget="5GiB",
    store="cpu",
    host_budget="100GiB",
    method="park",
)
CPU = dict(scale="small:n_layer=8,dropout=0.0", device="cpu:0", budget="3MiB", store="cpu:1", host_budget="1GiB")
CPU["method"] = "offload"


def union(spans: list[tuple[float, float]]) -> float:
    """Total length of the union of [start, end) spans."""
    total, end = 0.0, -1.0
    for s, e in sorted(spans):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


def summarise(prof: profile, active_steps: int) -> list[str]:
    """The GPU's busy time by kind, its window, and the host's busiest ops (self time), per profiled step."""
    kinds: dict[str, list[tuple[float, float]]] = collections.defaultdict(list)
    host = collections.Counter()
    for e in prof.events():
        dev = str(getattr(e, "device_type", ""))
        start = e.time_range.start
        end = e.time_range.end
        if "CUDA" in dev:
            name = e.name.lower()
            kind = (
                "copy HtoD"
                if "htod" in name
                else "copy DtoH"
                if "dtoh" in name
                else "copy DtoD"
                if "dtod" in name or "memcpy" in name
                else "memset"
                if "memset" in name
                else "kernel"
            )
            kinds[kind].append((start, end))
        else:
            host[e.name] += e.self_cpu_time_total
    out = []
    every = [s for spans in kinds.values() for s in spans]
    if every:
        window = max(e for _, e in every) - min(s for s, _ in every)
        busy = union(every)
        out.append(f"GPU window {window / 1e3 / active_steps:.1f} ms/step, busy {busy / 1e3 / active_steps:.1f}")
        for kind, spans in sorted(kinds.items()):
            out.append(f"  {kind:10s} {union(spans) / 1e3 / active_steps:8.1f} ms/step  ({len(spans)} events)")
        compute = union(kinds.get("kernel", []))
        out.append(f"  kernels alone {compute / 1e3 / active_steps:.1f} ms/step; idle {1 - busy / window:.0%}")
    out.append("host ops by self time (ms/step):")
    for name, us in host.most_common(25):
        out.append(f"  {us / 1e3 / active_steps:9.2f}  {name[:100]}")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu", action="store_true")
    ap.add_argument("--scale")
    ap.add_argument("--budget")
    ap.add_argument("--method")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--time-limit", type=float, default=30.0)
    ap.add_argument("--out", default=".")
    a = ap.parse_args()
    import bench_gpu_param_offload as bench

    from xsched.train import TrainConfig, train
    from xsched.train import loop as train_loop
    from xsched.train.records import Quiet

    setup = dict(CPU if a.cpu else GPU)
    setup.update({k: v for k, v in (("scale", a.scale), ("budget", a.budget), ("method", a.method)) if v})
    setup.update(cpu=a.cpu, steps=a.steps, time_limit=a.time_limit, profile_s=40.0)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    acts = [ProfilerActivity.CPU] + ([] if a.cpu else [ProfilerActivity.CUDA])
    active = 2
    prof = profile(activities=acts, schedule=schedule(wait=a.steps - active - 1, warmup=1, active=active))
    inner = train_loop._step

    def profiled_step(*args, **kwargs):
        r = inner(*args, **kwargs)
        prof.step()
        return r

    train_loop._step = profiled_step
    with tempfile.TemporaryDirectory() as cache:
        setup["cache_dir"] = cache
        device, store = setup["device"], setup["store"]
        config = TrainConfig(
            "zoo:gpt2",
            {device: setup["budget"], store: setup["host_budget"]},
            steps=setup["steps"],
            lr=bench.LR,
            scale=setup["scale"],
            method=setup["method"],
            time_limit=setup["time_limit"],
            profile="model" if a.cpu else "measure",
            cache_dir=cache,
            param_home=store,
            stores=(store,),
        )
        prof.start()
        r = train(config, Quiet())
        prof.stop()
    o = r.optimizer
    print(f"setup {r.setup_s:.1f} s; plan {r.plan_path}")
    for x in r.records:
        print(f"step {x.step}: {x.step_s * 1e3:.1f} ms, loss {x.loss:.4f}, peak {x.peak_bytes}")
    if o is not None:
        print(f"optimizer {o.optimizer_s:.3f} s, hidden {o.hidden_s:.3f} s, waited {o.waited_s:.3f} s (all steps)")
    lines = summarise(prof, active)
    print("\n".join(lines))
    trace = out / "diag_trace.json"
    prof.export_chrome_trace(str(trace))
    with open(trace, "rb") as f, gzip.open(str(trace) + ".gz", "wb") as g:
        shutil.copyfileobj(f, g)
    trace.unlink()
    (out / "diag.txt").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
