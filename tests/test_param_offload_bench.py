"""scripts/bench_gpu_param_offload.py in its reduced CPU mode (cpu:0 computes, cpu:1 stores): every row runs in its
own process and the table says whether its losses equal the reference's."""

from __future__ import annotations

import subprocess
import sys

from train_support import ROOT, child_env


def test_the_reduced_mode_runs_every_row(tmp_path) -> None:
    out = tmp_path / "bench.md"
    cmd = [sys.executable, str(ROOT / "scripts" / "bench_gpu_param_offload.py"), "--cpu", "--steps", "3"]
    p = subprocess.run([*cmd, "--out", str(out)], capture_output=True, text=True, env=child_env(), timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = {line.split(" | ")[0].strip("| "): line for line in out.read_text().splitlines() if line.startswith("| ")}
    assert "| reference | " in rows["reference"] and " ms | 1.00x |" in rows["reference"]
    for row in ("xsched", "fsdp2"):
        assert "| yes (max diff" in rows[row], rows[row]  # 3 losses equal the reference's
    assert "% | plan offload at 3MiB on cpu:0" in rows["xsched"]  # the optimizer's hidden share, then the plan
    assert "ZeRO-Offload needs a CUDA GPU" in rows["deepspeed"]
