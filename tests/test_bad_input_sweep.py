"""What a sweep of malformed command lines found, each fixed and held here (a one-line error, exit status 2, the
input named): time limits and gaps that are not finite positive numbers (they were accepted, and `inf` ran until
killed), plan and node-link files that are binary or gzipped (a UnicodeDecodeError traceback), an output path that is
a directory (the error named a temp file), and a GPU plan run on a host without that GPU (an AssertionError from
torch.cuda)."""

from __future__ import annotations

import gzip
from pathlib import Path

import pytest
import torch

from xsched.cli import main
from xsched.errors import XschedError

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "graphs"


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> tuple[Path, Path, Path]:
    d = tmp_path_factory.mktemp("bad")
    g, p, plan = d / "g.json", d / "p.json", d / "plan.json"
    assert main(["import", str(BENCH / "random_layered_n100.json"), "-o", str(g), "--profile-out", str(p)]) == 0
    assert main(["plan", str(g), str(p), "--method", "eager", "-o", str(plan)]) == 0
    return g, p, plan


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err and "\n" not in err and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("value", ["0", "-5", "nan", "inf"])
@pytest.mark.parametrize(
    "verb",
    [
        ["plan", "G", "P", "--budget", "bench=90%", "--time-limit"],
        ["report", "G", "--profile", "P", "--machine", "bench", "--time-limit"],
        ["train", "zoo:gpt2", "--scale", "tiny", "--time-limit"],
        ["demo", "gpt2", "--time-limit"],
    ],
    ids=lambda v: v[0] if isinstance(v, list) else v,
)
def test_time_limits_must_be_finite_positive_seconds(verb, value, files, capsys):
    g, p, _ = files
    argv = [str(g) if a == "G" else str(p) if a == "P" else a for a in verb] + [value]
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = one_line_error(capsys)
    assert f"argument {verb[-1]}" in err and repr(value) in err


@pytest.mark.parametrize("value", ["-5", "nan", "inf"])
def test_a_profiling_cap_must_be_finite_seconds(value, files, capsys):
    """`--max-time 0` measures nothing (every op modelled); below 0 or not finite is refused."""
    g, _, _ = files
    with pytest.raises(SystemExit) as e:
        main(["profile", str(g), "--devices", "cpu", "--max-time", value])
    assert e.value.code == 2
    err = one_line_error(capsys)
    assert "argument --max-time" in err and repr(value) in err


@pytest.mark.parametrize("value", ["-1", "1", "2", "nan", "inf"])
def test_a_plans_gap_must_be_relative(value, files, capsys, tmp_path):
    g, p, _ = files
    with pytest.raises(SystemExit) as e:
        main(["plan", str(g), str(p), "--budget", "bench=90%", "--gap", value, "-o", str(tmp_path / "x.json")])
    assert e.value.code == 2 and "must be a relative gap in [0, 1)" in one_line_error(capsys)


# the gzip's mtime fixed and named ids: pytest-xdist's workers must collect the same test names
CUT_GZIP = gzip.compress(b'{"schema": "xsched.plan/1"', mtime=0)[:-6]


@pytest.mark.parametrize("content", [b"\x80\x81 not text", CUT_GZIP], ids=["binary", "cut-gzip"])
def test_a_binary_or_cut_plan_or_graph_file_is_named_in_one_line(content, files, capsys, tmp_path):
    g, p, _ = files
    for name in ("bad.json", "bad.json.gz"):
        bad = tmp_path / name
        bad.write_bytes(content)
        assert main(["simulate", str(g), str(p), str(bad)]) == 2
        err = one_line_error(capsys)
        assert "cannot read plan file" in err and str(bad) in err
        assert main(["import", str(bad), "-o", str(tmp_path / "g2.json")]) == 2
        assert "cannot read node-link graph" in one_line_error(capsys)


def test_a_gzipped_plan_file_is_read(files, tmp_path):
    g, p, plan = files
    zipped = tmp_path / "plan.json.gz"
    zipped.write_bytes(gzip.compress(plan.read_bytes()))
    assert main(["simulate", str(g), str(p), str(zipped)]) == 0


def test_an_output_that_is_a_directory_is_named(tmp_path):
    """Profiles, checkpoints and run logs are written through `atomic_write`: a directory at the path is named, not
    the temp file beside it, and nothing is left there."""
    from xsched.files import atomic_write

    out = tmp_path / "adir.json"
    out.mkdir()
    with pytest.raises(IsADirectoryError) as e:
        atomic_write(out, lambda f: f.write(b"{}"))
    assert e.value.filename == str(out)
    assert not any(out.iterdir()) and [p.name for p in tmp_path.iterdir()] == ["adir.json"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a host without CUDA")
def test_a_gpu_plan_on_a_host_without_that_gpu_is_refused_in_one_line(tmp_path, capsys):
    from xsched.capture.torch import capture
    from xsched.execute.reference import device_present
    from xsched.solve import eager_plan
    from xsched.zoo import build

    z = build("mlp_mixer", scale="tiny")
    plan = tmp_path / "plan.json"
    eager_plan(capture(z.model, z.inputs), "cuda:0").save(plan)  # a plan made for a GPU (no GPU needed to make it)
    assert main(["run", "zoo:mlp_mixer", str(plan), "--scale", "tiny", "--iters", "1", "--warmup", "1"]) == 2
    err = one_line_error(capsys)
    assert "cuda:0" in err and "0 CUDA device(s)" in err
    with pytest.raises(XschedError, match="has 0 CUDA device"):
        device_present("cuda:1")
    assert device_present("cpu:1") == torch.device("cpu")


def test_xsched_trains_plan_names_an_op_no_device_runs(tmp_path):
    """`xsched train`'s planning (cached_plan) said "op cannot run on any of cpu (no cost in the profile)" from the
    solver where a profile left an op out (a bf16 batch norm's backward, before its statistics were typed): now one
    line naming the operator, its module and the device's reason, before any solver runs, as `wrap` says it."""
    from conftest import chain_graph

    from xsched.contracts.profile import DeviceInfo, OpCost, Profile
    from xsched.train.plans import cached_plan

    graph = chain_graph([100, 200, 300], train=True)
    left_out = graph.ops[-1].id
    costs = {o.id: OpCost(1e-3) for o in graph.ops if o.id != left_out}
    extra = {"unsupported": {"cpu": {left_out: "RuntimeError: mixed dtype (CPU): expect parameter to be Float"}}}
    profile = Profile(graph.fingerprint, {"cpu": DeviceInfo("cpu")}, {"cpu": costs}, {}, extra=extra)
    with pytest.raises(XschedError, match=r"operator t.bwd .*cannot run on any of cpu: RuntimeError: mixed dtype") as e:
        cached_plan(graph, {"cpu": "100%"}, ["cpu"], "eager", profile, cache_dir=tmp_path)
    assert "\n" not in str(e.value) and e.value.op == left_out
