"""scripts/bench_gpu_train_bf16.py in its reduced CPU mode: every row runs in its own process, and the bf16 losses of
checkpointing and of `xsched train --precision bf16` equal eager bf16's (CPU kernels are deterministic)."""

from __future__ import annotations

import subprocess
import sys

from train_support import ROOT, child_env


def test_the_reduced_mode_runs_every_row(tmp_path) -> None:
    out = tmp_path / "bench.md"
    cmd = [sys.executable, str(ROOT / "scripts" / "bench_gpu_train_bf16.py"), "--cpu", "--steps", "3"]
    cmd += ["--time-limit", "5", "--out", str(out)]
    p = subprocess.run(cmd, capture_output=True, text=True, env=child_env(), timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = {line.split(" | ")[0].strip("| "): line for line in out.read_text().splitlines() if line.startswith("| ")}
    assert " ms | 1.00x |" in rows["eager"] and "| reference |" in rows["eager"]
    for row in ("checkpoint", "xsched"):
        assert "| yes (max diff 0.0e+00) |" in rows[row], rows[row]
    assert "at 60% (predicted peak" in rows["xsched"]
    assert "needs the checkpoint row's measured GPU peak" in rows["xsched_equal"]
