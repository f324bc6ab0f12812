"""scripts/bench_gpu_param_offload.py in its reduced CPU mode (cpu:0 computes, cpu:1 stores): every row runs in its
own process, the table says whether its losses equal the reference's (the fast bf16 row: the eager bf16 reference
with the same delayed rule) and has the breakdown columns, and the JSON has every row. GPT-2 at the narrow 2-layer
scale of test_param_offload (1.67 MiB of parameters, cpu:0 at 3 MiB still parks): the rows' code is the same as at
the reduced mode's default 8 layers, for less of each row's capture and planning."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from train_support import ROOT, child_env


def test_the_reduced_mode_runs_every_row(tmp_path) -> None:
    out = tmp_path / "bench.md"
    cmd = [sys.executable, str(ROOT / "scripts" / "bench_gpu_param_offload.py"), "--cpu", "--steps", "3"]
    cmd += ["--scale", "small:n_layer=2,n_embd=128,n_head=2,seq=16", "--budget", "3MiB"]
    cmd += ["--rows", "reference,xsched,reference_bf16,xsched_fast,llama,torchao", "--json", str(tmp_path / "b.json")]
    cmd += ["--trace", str(tmp_path / "traces")]
    p = subprocess.run([*cmd, "--out", str(out)], capture_output=True, text=True, env=child_env(), timeout=400)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = {line.split(" | ")[0].strip("| "): line for line in out.read_text().splitlines() if line.startswith("| ")}
    assert "| reference | " in rows["reference"] and " ms | 1.00x |" in rows["reference"]
    assert "| yes (max diff" in rows["xsched"], rows["xsched"]  # 3 losses equal the reference's
    assert "| reference_bf16: yes (max diff" in rows["xsched_fast"], rows["xsched_fast"]
    assert "; plan offload at 3MiB on cpu:0" in rows["xsched"]
    for row in ("xsched", "xsched_fast", "llama"):  # the breakdown: compute, copies in and out, ... in ms
        cells = rows[row].split(" | ")
        assert all(c.endswith(" ms") for c in cells[8:16] + cells[17:20]), cells[8:20]
        for cell in cells[13:16]:  # each lane kind's thread CPU inside its tasks / their wall
            cpu, wall = cell.removesuffix(" ms").split(" / ")
            assert 0 <= int(cpu) and 0 <= int(wall), cells[13:16]
        switches, preempted = (int(x) for x in cells[16].split(" / "))  # the compute lane's thread (Linux)
        assert 0 <= preempted <= switches, cells[16]
    assert rows["llama"].split(" | ")[20].isdigit()  # tokens/s
    assert "CPUOffloadOptimizer needs a CUDA GPU" in rows["torchao"]
    saved = json.loads((tmp_path / "b.json").read_text())["rows"]
    assert set(saved) == set(rows) - {"row"} and saved["xsched"]["breakdown"]["compute_s"] > 0
    for row in ("xsched", "xsched_fast", "llama"):  # the plan's prediction beside the measured columns
        cells = rows[row].split(" | ")
        assert all(c.endswith(" ms") for c in cells[22:27]) and all(c.endswith("iB") for c in cells[27:29]), cells
        assert {"model", "capture", "plan", "wrap", "optimizer", "pin"} <= set(saved[row]["setup_stages"])
        assert sum(saved[row]["setup_stages"].values()) <= saved[row]["setup_s"]
    predicted_are_the_plans(saved["xsched"]["predicted"])
    kept = sorted(p.name for p in (tmp_path / "traces").iterdir())  # --trace: each xsched row's last step and plan
    assert len(kept) == 6 and all(n.endswith((".trace.json", ".plan.json")) for n in kept), kept
    trace = json.loads((tmp_path / "traces" / "gpt2-3MiB-fp32.trace.json").read_text())
    assert any(e["name"].startswith("steps ") for e in trace["traceEvents"])


def predicted_are_the_plans(p: dict) -> None:
    """The fp32 row's plan, every weight and buffer homed on cpu:1 (the store): each weight is copied in at least
    once (its first read; 2-layer GPT-2 small at width 128: 1.67 MiB of fp32 weights, counted from the model) and
    each gradient goes home; the step is the compute and the compute device's idle time, and the forward and the
    backward. (plan_traffic's counts against a hand count: tests/test_plan_traffic.py.)"""
    from xsched import zoo

    model = zoo.build_module("gpt2", "small:n_layer=2,n_embd=128,n_head=2,seq=16", device="meta")
    weights = sum(t.numel() * t.element_size() for t in model.parameters())
    assert p["bytes_in"] >= weights and p["bytes_out"] >= weights
    assert p["copies_in"] >= len(list(model.parameters())) and p["copies_out"] >= len(list(model.parameters()))
    assert p["step_s"] == pytest.approx(p["compute_s"] + p["compute_idle_s"])
    assert p["step_s"] == pytest.approx(p["forward_s"] + p["backward_s"])
    assert 0 < p["copy_in_s"] and 0 < p["copy_out_s"] and 0 < p["compute_s"] <= p["step_s"]


def test_row_limits_keep_the_reserve_of_later_rows() -> None:
    sys.path.insert(0, str(ROOT / "scripts"))
    from bench_rows_runner import row_limit

    setup = {"deadline": 1000.0, "reserve_s": {"llama": 180.0}}
    assert row_limit(setup, ["xsched", "llama", "torchao"], 600.0, 400.0) == 420.0  # 600 left, 180 kept
    assert row_limit(setup, ["xsched"], 600.0, 400.0) == 600.0  # no reserved row after it
    assert row_limit(setup, ["llama"], 200.0, 400.0) == 200.0  # the row timeout is less
    assert row_limit({}, ["llama"], 200.0, 999.0) == 200.0  # no deadline: the row timeout
    assert row_limit(setup, ["llama"], 600.0, 900.0) == -80.0  # under MIN_ROW_S: run_rows skips it
