"""The command line: each command end to end on small inputs, and bad input as a clear error with exit code 2."""

from __future__ import annotations

import json

import pytest
from conftest import BENCH

from xsched.cli import main
from xsched.contracts.graph import Graph
from xsched.contracts.plan import Plan
from xsched.contracts.profile import Profile

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


def _json(capsys) -> dict:
    return json.loads(capsys.readouterr().out)


def test_every_verb_on_a_small_model_with_json(tmp_path, capsys):
    src = tmp_path / "m.py"
    src.write_text(MODEL_FILE)
    model = f"{src}:factory"
    g, p, plan = tmp_path / "g.json", tmp_path / "p.json", tmp_path / "plan.json"
    assert main(["devices", "--json", "--no-sim"]) == 0
    assert any(row["kind"] == "cpu" for row in _json(capsys))
    assert main(["capture", model, "-o", str(g), "--json"]) == 0
    captured = _json(capsys)
    assert captured["fingerprint"] == Graph.load(g).fingerprint and captured["ops"] == len(Graph.load(g).ops)
    assert main(["profile", str(g), "--devices", "cpu", "--reps", "2", "--max-time", "5", "-o", str(p), "--json"]) == 0
    profiled = _json(capsys)["devices"]["cpu"]
    assert profiled["ops"] == captured["ops"]
    assert profiled["back_to_back"]["step_s"] > 0  # the eager step, run by the executor, calibrates the profile
    assert Profile.load(p).back_to_back["cpu"].alone_s == pytest.approx(profiled["sum_time_s"])
    args = ["plan", str(g), str(p), "--budget", "cpu=100%", "--method", "checkpoint", "-o", str(plan)]
    assert main([*args, "--json", "--explain"]) == 0
    planned = _json(capsys)
    assert planned["peak_bytes"]["cpu"] <= planned["budgets"]["cpu"]
    assert {r["value"] for r in planned["explain"]} >= {v for o in Graph.load(g).ops for v in o.outputs}
    assert main(["simulate", str(g), str(p), str(plan), "--json"]) == 0
    assert _json(capsys)["peak_bytes"] == planned["peak_bytes"]
    assert main(["run", model, str(plan), "--profile", str(p), "--iters", "3", "--warmup", "1", "--json"]) == 0
    ran = _json(capsys)
    assert ran["iters"] == 3 and ran["warmup_iters"] == 1 and len(ran["times_s"]) == 3 and ran["spread"] >= 0
    assert ran["predicted_peak_bytes"] == planned["peak_bytes"]


def test_plan_explain_names_the_recomputed_values_and_why(tmp_path, capsys):
    g, p, plan = tmp_path / "g.json", tmp_path / "p.json", tmp_path / "plan.json"
    main(["import", str(BENCH / "random_layered_n100.json"), "-o", str(g), "--profile-out", str(p)])
    capsys.readouterr()
    args = ["plan", str(g), str(p), "--method", "checkpoint", "--budget", "bench=80%", "-o", str(plan)]
    assert main([*args, "--explain", "--json"]) == 0
    out = _json(capsys)
    rows = out["explain"]
    recomputed = [r for r in rows if r["decision"].startswith("recomputed")]
    assert recomputed and all("recomputed at step" in r["reasons"][0] for r in recomputed)
    # one device: no plan's makespan is below every op once (a hand count of the imported costs)
    graph, profile = Graph.load(g), Profile.load(p)
    once = sum(profile.op_cost(o.id, "bench").time_s for o in graph.ops)
    assert out["makespan_bounds"][0]["seconds"] == pytest.approx(once)
    assert out["makespan_bounds"][0]["seconds"] <= out["makespan_s"]
    assert main([*args, "--explain"]) == 0
    text = capsys.readouterr().out
    assert all(r["value"] in text for r in recomputed) and "decision" in text
    assert "no plan's makespan is below" in text


def test_user_mistakes_are_one_line_with_status_2(tmp_path, capsys):
    src = tmp_path / "m.py"
    src.write_text(MODEL_FILE)
    g, p, plan = tmp_path / "g.json", tmp_path / "p.json", tmp_path / "plan.json"
    main(["import", str(BENCH / "random_layered_n100.json"), "-o", str(g), "--profile-out", str(p)])
    main(["plan", str(g), str(p), "--method", "eager", "-o", str(plan)])
    capsys.readouterr()
    mistakes = [
        ["plan"],  # missing arguments
        ["no-such-verb"],
        ["plan", str(g), str(p), "--budget", "bench", "-o", str(tmp_path / "x.json")],
        ["plan", str(g), str(p), "--budget", "bench=lots", "-o", str(tmp_path / "x.json")],
        ["plan", str(g), str(p), "--method", "magic", "-o", str(tmp_path / "x.json")],
        ["profile", str(g), "--devices", "abacus:0", "-o", str(tmp_path / "x.json")],
        ["simulate", str(g), str(tmp_path / "missing.json")],
        ["import", str(src), "-o", str(tmp_path / "x.json")],
        ["run", f"{src}:factory", str(plan), "--iters", "1"],  # a plan made for another graph
        ["run", f"{src}:factory", str(plan), "--iters", "0"],
    ]
    for argv in mistakes:
        try:
            code = main(argv)
        except SystemExit as e:  # argparse's own errors
            code = e.code
        err = capsys.readouterr().err.strip()
        assert code == 2, argv
        assert len(err.splitlines()) == 1 and "error" in err, (argv, err)
        assert "Traceback" not in err
    assert not (tmp_path / "x.json").exists()


def test_warm_up_runs_until_the_times_settle():
    from xsched.execute.run_report import SETTLE_WINDOW, warm_up

    durations = iter([0.5, 0.3, 0.2, 0.11, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1])
    now = [0.0]
    calls: list[int] = []

    def clock() -> float:
        return now[0]

    def run() -> None:
        calls.append(1)
        now[0] += next(durations)

    n = warm_up(run, clock=clock)
    # runs 1-3 are still falling; from run 4 on the last SETTLE_WINDOW agree within 5%: settled after run 3 + window
    assert n == len(calls) == 3 + SETTLE_WINDOW
    assert warm_up(run, fixed=2, clock=clock) == 2


# what `xsched plan`, `simulate` and `report` on graph files run, in a fresh interpreter that reports what it imported
NO_TORCH_RUN = """
import sys
from xsched.cli import main

bench = sys.argv[1]
assert main(["import", bench, "-o", "g.json", "--profile-out", "p.json"]) == 0
assert main(["plan", "g.json", "p.json", "--budget", "bench=90%", "--time-limit", "0.3", "-o", "plan.json"]) == 0
assert main(["simulate", "g.json", "p.json", "plan.json"]) == 0
report = ["--machine", "bench", "-o", "report", "--points", "2", "--time-limit", "0.2", "--sections", "sweep"]
assert main(["report", "g.json", "--profile", "p.json", *report, "--baselines", "eager", "--quiet"]) == 0
print("IMPORTED", sorted(m for m in ("torch", "xsched.capture", "xsched.execute") if m in sys.modules))
"""


def test_planning_from_graph_files_imports_no_torch(tmp_path):
    """Planning, simulating and reporting on a graph file and its profile import neither torch nor the executor:
    the command starts in a fraction of a second (scripts/bench_time_limit.py times it; nothing is timed here)."""
    import subprocess
    import sys

    run = subprocess.run(
        [sys.executable, "-c", NO_TORCH_RUN, str(BENCH / "random_layered_n100.json")],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=False,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert "IMPORTED []" in run.stdout, run.stdout[-500:]


def test_the_plan_time_limit_is_the_commands(tmp_path, monkeypatch):
    """`xsched plan --time-limit L` run as the process's own command: what loading took (from when xsched.cli
    loaded) is taken off the solver's limit, so the command keeps L; called with an argv, the clock starts there."""
    import xsched.cli
    import xsched.solve.api
    from xsched.errors import XschedError

    g, p = tmp_path / "g.json", tmp_path / "p.json"
    assert main(["import", str(BENCH / "random_layered_n100.json"), "-o", str(g), "--profile-out", str(p)]) == 0
    limits: list[float] = []

    def solve(graph, profile, budgets, devices, method, options):
        limits.append(options.time_limit_s)
        raise XschedError("stopped here", stage="solve")

    monkeypatch.setattr(xsched.solve.api, "solve", solve)
    argv = ["plan", str(g), str(p), "--budget", "bench=90%", "--time-limit", "5", "-o", str(tmp_path / "plan.json")]
    assert main(argv) == 2
    monkeypatch.setattr(xsched.cli, "LOADED", xsched.cli.LOADED - 4.0)  # as if loading had taken 4 s
    monkeypatch.setattr("sys.argv", ["xsched", *argv])
    assert main() == 2
    assert 4.0 < limits[0] <= 5.0 and limits[1] <= 1.0
