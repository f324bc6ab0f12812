"""`xsched report` end to end (exit codes, --json, user errors as one line with status 2), and Chrome traces:
`xsched run --trace` (measured, one event per executed step) and the simulator's predicted trace."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from conftest import chain_graph
from torch import nn

from xsched.capture.torch import bind_inputs, capture
from xsched.cli import main
from xsched.contracts.plan import Copy, Plan
from xsched.errors import XschedError
from xsched.profiling.measure import profile_graph
from xsched.profiling.model import cost_profile
from xsched.report.trace import measured_trace, predicted_trace
from xsched.simulate import simulate
from xsched.solve.api import solve
from xsched.solve.reference import eager_plan

MODEL_FILE = """
import torch
from torch import nn

def factory(batch=4):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)), (torch.randn(batch, 8),)
"""


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A training chain's graph JSON and a profile of it on a simulated GPU and a simulated CPU."""
    d = tmp_path_factory.mktemp("cli")
    graph = chain_graph([4000, 16000, 8000, 2000], train=True)
    graph.save(d / "g.json")
    profile_graph(graph, ["sim:rtx4090", "sim:xeon-8480"], progress=False).save(d / "p.json")
    return d


def test_report_json_and_a_device_added_to_the_profile(files, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out = tmp_path / "rep"
    argv = [
        "report",
        str(files / "g.json"),
        "--profile",
        str(files / "p.json"),
        "-o",
        str(out),
        "--machine",
        "sim:rtx4090+sim:xeon-8480",
        "--machine",
        "sim:t4@60%mem+sim:xeon-8480",
        "--sections",
        "whatif,pictures",
        "--method",
        "checkpoint",
        "--baselines",
        "eager",
        "--points",
        "2",
        "--quiet",
        "--json",
    ]
    assert main(argv) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["html"] == str(out / "report.html") and (out / "report.html").is_file()
    assert all((out / name).is_file() for name in summary["files"])
    assert [m["machine"] for m in summary["machines"]] == [
        "sim:rtx4090 + sim:xeon-8480",
        "sim:t4@60%mem + sim:xeon-8480",
    ]
    assert summary["machines"][1]["budgets"]["sim:t4"] == int(0.6 * 16 * 2**30)
    assert all(m["best"]["time_s"] > 0 for m in summary["machines"])
    assert "sim:t4" in json.loads((out / "profile.json").read_text())["devices"]  # measured (modelled) and added
    assert summary["command"].startswith("xsched report ")
    assert main(argv[:-1]) == 0  # the same without --json: lines for people
    assert "report ->" in capsys.readouterr().out


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--machine", "sim:rtx4090+"], "a machine is DEVICE[@BUDGET]"),
        (["--machine", "sim:nope+sim:xeon-8480"], "no device spec named 'nope'"),
        (["--sections", "sweep,nope"], "unknown section 'nope'"),
        (["--method", "nope"], "unknown method 'nope'"),
        (["--points", "1"], "--points must be at least 2"),
        (["--machine", "sim:rtx4090@lots"], "cannot parse budget 'lots'"),
    ],
)
def test_report_user_errors_are_one_line_exit_2(files, tmp_path, capsys, extra, message):
    pytest.importorskip("matplotlib")
    argv = [
        "report",
        str(files / "g.json"),
        "--profile",
        str(files / "p.json"),
        "-o",
        str(tmp_path / "r"),
        "--quiet",
        "--points",
        "2",
        "--sections",
        "pictures",
        "--machine",
        "sim:rtx4090",
        *extra,
    ]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("xsched: error: ") and message in err and err.count("\n") == 1, err
    assert not (tmp_path / "r").exists()  # nothing written


def test_report_without_matplotlib_or_profile_file(files, tmp_path, capsys, monkeypatch):
    argv = ["report", str(files / "g.json"), "--profile", str(tmp_path / "none.json"), "-o", str(tmp_path / "r")]
    if "matplotlib" in sys.modules or pytest.importorskip("matplotlib"):
        assert main(argv) == 2
        assert "no profile file" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "pip install xsched[report]" in err and err.count("\n") == 1
    assert not (tmp_path / "r").exists()


def _x_events(trace):
    names = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    for e in events:
        assert {"name", "ts", "dur", "pid", "tid", "args"} <= set(e) and e["dur"] >= 0 and e["ts"] >= 0
        assert e["tid"] in names
    return events, names


def test_run_trace_writes_one_event_per_executed_step(tmp_path, capsys):
    src = tmp_path / "m.py"
    src.write_text(MODEL_FILE)
    graph_file = tmp_path / "g.json"
    assert main(["capture", f"{src}:factory", "-o", str(graph_file)]) == 0
    from xsched.contracts.graph import Graph

    plan = eager_plan(Graph.load(graph_file), "cpu")
    plan.save(tmp_path / "plan.json")
    trace_file = tmp_path / "t.json"
    assert main(["run", f"{src}:factory", str(tmp_path / "plan.json"), "--iters", "1", "--trace", str(trace_file)]) == 0
    assert f"-> {trace_file}" in capsys.readouterr().out
    trace = json.loads(trace_file.read_text())
    events, names = _x_events(trace)
    assert sorted(e["args"]["step"] for e in events) == list(range(len(plan.steps)))
    assert set(names.values()) == {"compute:cpu"}  # frees inline on the compute lane, as the executor runs them
    by_step = sorted(events, key=lambda e: e["args"]["step"])
    assert all(a["ts"] + a["dur"] <= b["ts"] + 1e-3 for a, b in zip(by_step, by_step[1:]))  # one thread, in order
    assert (tmp_path / "m.py").exists() and trace["otherData"]["source"].startswith("measured")


def test_measured_trace_on_lanes_and_predicted_trace_match_their_models(one_thread):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 2))
    inputs = (torch.randn(4, 8),)
    graph = capture(model, inputs)
    profile = cost_profile(graph, ["cpu:0", "cpu:1"])
    homes = {v: "cpu:1" for v in graph.inputs}  # greedy fills cpu:0 first: copies in, gradients back
    plan = solve(graph, profile, {}, ["cpu:0", "cpu:1"], "greedy", homes=homes)
    assert any(isinstance(s, Copy) for s in plan.steps)
    trace = measured_trace(graph, plan, bind_inputs(graph, model, inputs), overlap=True)
    events, names = _x_events(trace)
    assert len(events) == len(plan.steps) and trace["otherData"]["overlap"] is True
    copies = [e for e in events if e["cat"] == "copy"]
    assert copies and all(names[e["tid"]].startswith("copy:") for e in copies)
    assert all(e["args"]["thread"].startswith("xsched-copy:") for e in copies)  # ran on the copy lane's thread
    predicted = predicted_trace(graph, plan, profile)
    spans = simulate(graph, plan, profile).step_span
    pe, _ = _x_events(predicted)
    assert [e["ts"] for e in pe] == pytest.approx([a * 1e6 for a, _ in spans])
    assert [e["dur"] for e in pe] == pytest.approx([(b - a) * 1e6 for a, b in spans])
    assert isinstance(Plan.from_dict(plan.to_dict()), Plan)


def test_report_captures_a_model_for_its_machines_devices(tmp_path, monkeypatch):
    """As `xsched profile` does: a machine with a GPU, real or simulated, gets the graph its GPU runs (CUDA's dtypes
    and dropout), a CPU-only one the CPU's (the capture is stopped there: no GPU here to profile)."""
    import xsched.loaders as loaders

    typed = []

    def stop(spec, **kw):
        typed.append(kw.get("device_type"))
        raise XschedError("stopped after the capture's arguments", stage="test")

    monkeypatch.setattr(loaders, "load_graph", stop)
    machines = ("cuda:0+cpu", "cpu", "sim:h100+cpu", "sim:l4#0+sim:l4#1+cpu", "sim:xeon-8480")
    for machine in machines:
        assert main(["report", "zoo:gpt2", "--scale", "tiny", "--machine", machine, "-o", str(tmp_path / "r")]) == 2
    assert typed == ["cuda", "cpu", "cuda", "cuda", "cpu"]


def test_a_profile_made_on_the_cpus_capture_still_serves_a_gpu_machine(tmp_path, capsys):
    """README's "profile once here, then ask about other machines": `xsched profile MODEL --devices cpu` profiled
    the CPU's capture, and a machine with a simulated GPU would capture the GPU's (fused dropout), which that profile
    is not for. The report plans the capture the profile was made on, and says so in one line; a profile of another
    model is still refused."""
    from xsched import zoo

    z = zoo.build("gpt2", scale="tiny")
    on_cpu = capture(z.model, z.inputs, name="zoo:gpt2", device_type="cpu")
    cost_profile(on_cpu, ["cpu"]).save(tmp_path / "cpu.json")
    args = ["--machine", "sim:rtx4090+cpu", "--points", "2", "--time-limit", "0.2", "--sections", "sweep"]
    args += ["--baselines", "eager", "--quiet"]
    out = tmp_path / "r"
    assert (
        main(["report", "zoo:gpt2", "--scale", "tiny", "--profile", str(tmp_path / "cpu.json"), "-o", str(out), *args])
        == 0
    )
    assert "was made on the CPU's capture of zoo:gpt2" in capsys.readouterr().err
    assert json.loads((out / "profile.json").read_text())["graph"] == on_cpu.fingerprint
    assert (
        main(
            [
                "report",
                "zoo:mlp_mixer",
                "--scale",
                "tiny",
                "--profile",
                str(tmp_path / "cpu.json"),
                "-o",
                str(out),
                *args,
            ]
        )
        == 2
    )
    assert "profile is for graph" in capsys.readouterr().err
