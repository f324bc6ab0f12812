"""The command line: each command end to end on small inputs, and bad input as a clear error with exit code 2."""

from __future__ import annotations

import json

from conftest import BENCH

from xsched.cli import main
from xsched.graph import Graph
from xsched.plan import Plan

MODEL_FILE = """
import torch
from torch import nn

def factory(batch=4):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)), (torch.randn(batch, 8),)

class Branchy(nn.Module):
    def forward(self, x):
        if x.sum() > 0:
            return x * 2
        return x

def branchy(batch=2):
    return Branchy(), (torch.randn(batch, 3),)
"""


def test_import_plan_simulate(tmp_path, capsys):
    g, p, plan = tmp_path / "g.json", tmp_path / "p.json", tmp_path / "plan.json"
    assert main(["import", str(BENCH / "random_layered_n100.json"), "-o", str(g), "--profile-out", str(p)]) == 0
    assert len(Graph.load(g).ops) == 100
    assert main(["plan", str(g), str(p), "--method", "eager", "-o", str(plan)]) == 0
    capsys.readouterr()
    assert main(["simulate", str(g), str(p), str(plan), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["peak_bytes"] == {"bench": 50_590} and report["recomputes"] == 0
    tight = tmp_path / "tight.json"
    assert main(["plan", str(g), str(p), "--method", "checkpoint", "--budget", "bench=90%", "-o", str(tight)]) == 0
    assert Plan.load(tight).budgets == {"bench": int(50_590 * 0.9)}
    assert main(["simulate", str(g), str(tight)]) == 0  # without a profile: validity and memory only


def test_capture_from_a_model_file(tmp_path):
    src = tmp_path / "m.py"
    src.write_text(MODEL_FILE)
    out = tmp_path / "m.json"
    assert main(["capture", f"{src}:factory", "--batch", "3", "-o", str(out)]) == 0
    g = Graph.load(out)
    assert {o.phase for o in g.ops} == {"fwd", "bwd"}
    assert g.value["input:0"].shape == (3, 8)


def test_bad_inputs_exit_2_with_a_message(tmp_path, capsys):
    src = tmp_path / "m.py"
    src.write_text(MODEL_FILE)
    assert main(["capture", f"{src}:branchy", "-o", str(tmp_path / "b.json")]) == 2
    assert f"{src}:11" in capsys.readouterr().err  # names the line of the data-dependent branch
    assert main(["capture", "no_such_model", "-o", str(tmp_path / "x.json")]) == 2
    assert "MODEL must be" in capsys.readouterr().err
    (tmp_path / "corrupt.json").write_text('{"schema": "xsched.graph/1", "values": [')
    assert main(["simulate", str(tmp_path / "corrupt.json"), str(tmp_path / "corrupt.json")]) == 2
    assert "cannot read graph file" in capsys.readouterr().err


def test_infeasible_budget_names_device_and_bound(tmp_path, capsys):
    g, p = tmp_path / "g.json", tmp_path / "p.json"
    main(["import", str(BENCH / "random_layered_n100.json"), "-o", str(g), "--profile-out", str(p)])
    capsys.readouterr()
    assert (
        main(["plan", str(g), str(p), "--method", "milp", "--budget", "bench=100", "-o", str(tmp_path / "x.json")]) == 2
    )
    err = capsys.readouterr().err
    assert "bench" in err and "budget" in err
    assert not (tmp_path / "x.json").exists()
