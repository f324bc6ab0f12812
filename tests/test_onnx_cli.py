"""ONNX models through the command line (capture, profile, plan, run with --shape), and xsched without onnx."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from xsched.cli import main

ROOT = Path(__file__).resolve().parents[1]


def test_pipeline_on_an_onnx_file(tmp_path, capsys, monkeypatch):
    from onnx_models import zoo_onnx

    monkeypatch.chdir(tmp_path)  # profiles/ and the like stay in the test's folder
    model = tmp_path / "resnet.onnx"
    model.write_bytes(zoo_onnx("resnet18", dynamic=True).SerializeToString())
    g, p, plan = (str(tmp_path / n) for n in ("g.json", "p.json", "plan.json"))
    shape = ["--shape", "in0=2x3x32x32"]
    assert main(["capture", str(model), *shape, "-o", g]) == 0
    assert json.loads(Path(g).read_text())["values"][0]["shape"] == [2, 3, 32, 32]
    assert (
        main(
            [
                "profile",
                str(model),
                *shape,
                "--devices",
                "ort:cpu",
                "--reps",
                "3",
                "--max-time",
                "0",
                "--quiet",
                "-o",
                p,
            ]
        )
        == 0
    )
    assert main(["plan", g, p, "--method", "checkpoint", "--budget", "ort:cpu=100%", "-o", plan]) == 0
    capsys.readouterr()
    assert main(["run", str(model), plan, *shape, "--profile", p, "--iters", "2"]) == 0
    out = capsys.readouterr().out
    assert "plain session" in out and "largest difference from the plain session 0" in out
    # the plan was made for batch 2: another batch captures another graph
    assert main(["run", str(model), plan, "--shape", "in0=4x3x32x32", "--iters", "1"]) == 2
    assert "plan it again for this model" in capsys.readouterr().err


def test_bad_onnx_inputs_exit_2_with_one_line(tmp_path, capsys):
    pytest.importorskip("onnx")
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"\x08\x07garbage" * 10)
    for argv in (
        ["capture", str(bad), "-o", str(tmp_path / "g.json")],
        ["capture", str(tmp_path / "none.onnx"), "-o", str(tmp_path / "g.json")],
        ["capture", str(bad), "--shape", "x=1,2", "-o", str(tmp_path / "g.json")],
        ["capture", "zoo:resnet18", "--shape", "x=1x2", "-o", str(tmp_path / "g.json")],
    ):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("xsched: error:") and err.count("\n") == 1, err


def test_xsched_works_without_onnx():
    """With onnx and onnxruntime absent, xsched imports (ONNX modules included) and says how to install them."""
    code = (
        "import sys\n"
        "for m in ('onnx', 'onnxruntime', 'onnxscript'): sys.modules[m] = None\n"
        "import xsched, xsched.cli, xsched.loaders, xsched.devices.ort, xsched.capture.onnx, xsched.execute.ort_executor\n"
        "import xsched.execute.ort_session, xsched.execute.ort_measure\n"
        "from xsched.devices import available_devices, get_device\n"
        "assert not [r for r in available_devices(include_sim=False) if r.kind == 'ort']\n"
        "for call in (lambda: get_device('ort:cpu'), lambda: xsched.capture.onnx.capture_onnx('m.onnx')):\n"
        "    try:\n"
        "        call()\n"
        "    except xsched.XschedError as e:\n"
        "        print(e)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert len(lines) == 2 and all("is not installed: pip install 'xsched[onnx]'" in line for line in lines), lines
