"""A real-data run of `xsched train`: GPT-2 (zoo, small: 4 layers, 64 wide, a vocabulary of 256) learns the licence
texts that torch, numpy and scipy install (found through importlib.metadata, in a fixed order), tokenised as bytes,
nothing downloaded. The first 90% of the bytes are the training tokens, the last 10% the validation ones, each a
uint16 .bin as nanoGPT writes it; then `xsched train` runs on them (as a subprocess, the command printed) and the
validation losses are shown, first and last.

    python scripts/train_real_data.py --out runs/licences               # 300 steps, cpu=70%, about 2 min here
    python scripts/train_real_data.py --out runs/licences --steps 10 -- --profile model   # extra flags after --
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np

PACKAGES = ("torch", "numpy", "scipy")  # xsched's own dependencies: always installed with it
LICENCE = re.compile(r"(LICEN[CS]E|COPYING|NOTICE)", re.IGNORECASE)


def licence_files() -> list[Path]:
    """The licence files the PACKAGES' distributions list, sorted by package and path."""
    out = []
    for name in PACKAGES:
        files = importlib.metadata.distribution(name).files or []
        out += sorted((f.locate() for f in files if LICENCE.search(f.name)), key=str)
    return [Path(p) for p in out if Path(p).is_file()]


def write_tokens(out: Path) -> tuple[Path, Path, int]:
    """train.bin and val.bin under `out` (byte tokens, 90/10 split); returns their paths and the text's bytes."""
    text = b"\n".join(p.read_bytes() for p in licence_files())
    ids = np.frombuffer(text, dtype=np.uint8).astype(np.uint16)
    cut = len(ids) * 9 // 10
    out.mkdir(parents=True, exist_ok=True)
    ids[:cut].tofile(out / "train.bin")
    ids[cut:].tofile(out / "val.bin")
    return out / "train.bin", out / "val.bin", len(text)


def command(out: Path, steps: int, budget: str, extra: list[str]) -> list[str]:
    return [
        *("xsched", "train", "zoo:gpt2", "--scale", "small", "--batch", "16", "--budget", f"cpu={budget}"),
        *("--steps", str(steps)),
        *(
            "--data",
            str(out / "train.bin"),
            "--val-data",
            str(out / "val.bin"),
            "--eval-every",
            str(max(1, steps // 12)),
        ),
        *("--lr", "3e-3", "--lr-schedule", "cosine", "--warmup", str(steps // 20), "--min-lr", "3e-4"),
        *("--clip-grad", "1.0", "--time-limit", "20", "--cache-dir", str(out / "cache"), "--json"),
        *("--log-csv", str(out / "log.csv"), *extra),
    ]


def main(argv: list[str] | None = None) -> dict[int, float]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("runs/licences"))
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--budget", default="70%", help="the CPU's budget (default 70%% of the eager peak)")
    parser.add_argument("extra", nargs="*", help="more `xsched train` flags, after --")
    a = parser.parse_args(argv)
    train, val, size = write_tokens(a.out)
    print(f"{len(licence_files())} licence files of {', '.join(PACKAGES)}: {size} bytes -> {train}, {val}")
    cmd = command(a.out, a.steps, a.budget, a.extra)
    print("$ " + " ".join(cmd), flush=True)
    run = subprocess.run([sys.executable, "-m", "xsched.cli", *cmd[1:]], capture_output=True, text=True)
    if run.returncode:
        sys.exit(f"xsched train failed ({run.returncode}): {run.stderr.strip().splitlines()[-1:]}")
    lines = [json.loads(line) for line in run.stdout.splitlines() if line.strip()]
    vals = {e["step"] + 1: e["val_loss"] for e in lines if e["event"] == "step" and e["val_loss"] is not None}
    start, end = lines[0], lines[-1]
    print(f"plan {start['method']} ({start['status']}): budget {start['budgets']} bytes, predicted peak ", end="")
    print(f"{start['predicted']['peak_bytes']} bytes")
    print(f"validation loss after each evaluation (steps done: loss): {vals}")
    print(f"first {vals[min(vals)]:.4f} (after {min(vals)} steps), last {vals[max(vals)]:.4f} (after {max(vals)})")
    print(
        f"training loss at the end {end['final_loss']:.4f}; {end['time_s']:.1f} s of steps, setup {end['setup_s']:.1f} s"
    )
    return vals


if __name__ == "__main__":
    main()
