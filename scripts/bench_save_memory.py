"""The host memory a save takes beyond the model, for a Hugging Face GPT-2 (from a config, nothing downloaded) whose
parameters are packed into HostAdamW's flat buckets: with the wrapped model's state hooks (each saved tensor its
weight's own memory) and without them (the buckets' shared storages, as before), beside the eager model; for
torch.save of the state_dict, safetensors' save_model and save_pretrained. Each row runs in a fresh process; the
peak is the resident set sampled every millisecond during the save, less the one before it.

    python scripts/bench_save_memory.py [--layers 6 --width 512]"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODES = ("eager", "packed, no hooks", "packed, state hooks")
SAVERS = ("torch.save(state_dict)", "safetensors save_model", "save_pretrained")


def rss() -> int:
    """This process's resident bytes now."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def peak_during(fn) -> int:  # noqa: ANN001
    """The most resident bytes above the level before `fn()` while it runs (sampled each millisecond)."""
    base, peak, done = rss(), [0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], rss() - base)
            time.sleep(0.001)

    t = threading.Thread(target=sample)
    t.start()
    try:
        fn()
    finally:
        done.set()
        t.join()
    return max(peak[0], rss() - base)


def one(mode: str, saver: str, layers: int, width: int) -> dict:
    """Build, pack as `mode` says, save with `saver` into a temporary folder: the peak above the model and the
    bytes written."""
    import torch
    import transformers
    from safetensors.torch import save_model

    from xsched.execute.param_home import ListenerSlot
    from xsched.execute.state_hooks import install_state_hooks
    from xsched.train.host_adamw import HostAdamW

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=layers, n_embd=width, n_head=max(1, width // 64))
    model = transformers.GPT2LMHeadModel(config)
    host = None
    if mode != "eager":
        named = list(model.named_parameters())
        host = HostAdamW(named, {n: 0.0 for n, _ in named}, lr=1e-3)
    if mode == "packed, state hooks":
        install_state_hooks(model, ListenerSlot())
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "model"
        save = {
            "torch.save(state_dict)": lambda: torch.save(model.state_dict(), out),
            "safetensors save_model": lambda: save_model(model, str(out)),
            "save_pretrained": lambda: model.save_pretrained(out),
        }[saver]
        try:
            peak = peak_during(save)
            error = None
        except RuntimeError as e:
            peak, error = None, str(e).split("\n")[0][:120]
        files = [out] if out.is_file() else list(out.glob("*")) if out.exists() else []
        written = sum(f.stat().st_size for f in files)
    if host is not None:
        host.close()
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"mode": mode, "saver": saver, "params": params, "peak": peak, "written": written, "error": error}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--one", nargs=2, help=argparse.SUPPRESS)  # a row, in this (fresh) process
    a = ap.parse_args()
    if a.one:
        print(json.dumps(one(a.one[0], a.one[1], a.layers, a.width)))
        return
    mib = 1 << 20
    print("| weights | saver | peak above the model | written | error |\n|---|---|---|---|---|")
    for saver in SAVERS:
        for mode in MODES:
            argv = [sys.executable, __file__, "--layers", str(a.layers), "--width", str(a.width), "--one", mode, saver]
            row = json.loads(subprocess.run(argv, capture_output=True, text=True, check=True, cwd=ROOT).stdout)
            peak = "-" if row["peak"] is None else f"{row['peak'] / mib:.0f} MiB"
            print(
                f"| {mode} ({row['params'] / mib:.0f} MiB) | {saver} | {peak} | {row['written'] / mib:.0f} MiB "
                f"| {row['error'] or ''} |"
            )


if __name__ == "__main__":
    main()
