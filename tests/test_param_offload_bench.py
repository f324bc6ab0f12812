"""scripts/bench_gpu_param_offload.py in its reduced CPU mode (cpu:0 computes, cpu:1 stores): every row runs in its
own process, the table says whether its losses equal the reference's (the fast bf16 row: the eager bf16 reference
with the same delayed rule) and has the breakdown columns, and the JSON has every row. GPT-2 at the narrow 2-layer
scale of test_param_offload (1.67 MiB of parameters, cpu:0 at 3 MiB still parks): the rows' code is the same as at
the reduced mode's default 8 layers, for less of each row's capture and planning."""

from __future__ import annotations

import json
import subprocess
import sys

from train_support import ROOT, child_env


def test_the_reduced_mode_runs_every_row(tmp_path) -> None:
    out = tmp_path / "bench.md"
    cmd = [sys.executable, str(ROOT / "scripts" / "bench_gpu_param_offload.py"), "--cpu", "--steps", "3"]
    cmd += ["--scale", "small:n_layer=2,n_embd=128,n_head=2,seq=16", "--budget", "3MiB"]
    cmd += ["--rows", "reference,xsched,reference_bf16,xsched_fast,llama,torchao", "--json", str(tmp_path / "b.json")]
    p = subprocess.run([*cmd, "--out", str(out)], capture_output=True, text=True, env=child_env(), timeout=400)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = {line.split(" | ")[0].strip("| "): line for line in out.read_text().splitlines() if line.startswith("| ")}
    assert "| reference | " in rows["reference"] and " ms | 1.00x |" in rows["reference"]
    assert "| yes (max diff" in rows["xsched"], rows["xsched"]  # 3 losses equal the reference's
    assert "| reference_bf16: yes (max diff" in rows["xsched_fast"], rows["xsched_fast"]
    assert "| plan offload at 3MiB on cpu:0" in rows["xsched"]
    for row in ("xsched", "xsched_fast", "llama"):  # the breakdown: compute, copies in and out, ... in ms
        cells = rows[row].split(" | ")
        assert all(c.endswith(" ms") for c in cells[8:16]), cells[8:16]
    assert rows["llama"].split(" | ")[16].isdigit()  # tokens/s
    assert "CPUOffloadOptimizer needs a CUDA GPU" in rows["torchao"]
    saved = json.loads((tmp_path / "b.json").read_text())["rows"]
    assert set(saved) == set(rows) - {"row"} and saved["xsched"]["breakdown"]["compute_s"] > 0


def test_row_limits_keep_the_reserve_of_later_rows() -> None:
    sys.path.insert(0, str(ROOT / "scripts"))
    from bench_rows_runner import row_limit

    setup = {"deadline": 1000.0, "reserve_s": {"llama": 180.0}}
    assert row_limit(setup, ["xsched", "llama", "torchao"], 600.0, 400.0) == 420.0  # 600 left, 180 kept
    assert row_limit(setup, ["xsched"], 600.0, 400.0) == 600.0  # no reserved row after it
    assert row_limit(setup, ["llama"], 200.0, 400.0) == 200.0  # the row timeout is less
    assert row_limit({}, ["llama"], 200.0, 999.0) == 200.0  # no deadline: the row timeout
    assert row_limit(setup, ["llama"], 600.0, 900.0) == -80.0  # under MIN_ROW_S: run_rows skips it
