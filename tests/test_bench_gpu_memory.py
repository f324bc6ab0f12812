"""Smoke run of the prepared GPU memory benchmark (scripts/bench_gpu_memory.py) in its reduced mode on logical CPUs:
every row runs, the xsched plans train like eager PyTorch and stay within their budgets, the files come out."""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

import pytest
import torch

from xsched.contracts.graph import Graph
from xsched.contracts.profile import Profile
from xsched.solve.reference import eager_peak

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import bench_gpu_memory as bench  # noqa: E402
import bench_gpu_torch_rows as torch_rows  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench_gpu_memory")
    argv = ["--device", "cpu", "--scale", "small:n_layer=2", "--batch", "16", "--budgets", "50", "--iters", "2"]
    argv += [
        "--warmup",
        "1",
        "--time-limit",
        "2",
        "--profile-s",
        "30",  # a cap, not a duration (the rounds end it): room for the eager steps on a loaded machine
        "--jobs",
        "2",
        "--lanes",
        "--expandable-segments",
        "--planned-addresses",
    ]
    argv += ["--json", str(out / "run.json"), "--out", str(out / "run.md"), "--save-profile", str(out)]
    assert bench.main(argv) == 0
    return out, json.loads((out / "run.json").read_text())


def test_every_row_runs_or_says_why(run):
    out, got = run
    rows = {r["plan"]: r for r in got["rows"]}
    assert list(rows) == [
        "eager PyTorch",
        "torch.utils.checkpoint per block",
        "save_on_cpu(pin_memory=True)",
        "torchtune OffloadActivations",
        "torch.compile",
        "torch.compile, activation_memory_budget 0.5",
        "xsched eager plan",
        "xsched eager plan, expandable segments",
        "xsched eager plan, planned addresses",
        "xsched 50%, cpu:0 alone",
        "xsched 50%, cpu:0 alone, expandable segments",
        "xsched 50%, cpu:0 alone, planned addresses",
        "xsched 50%, cpu:1 store",
        "xsched 50%, cpu:1 store, expandable segments",
        "xsched 50%, cpu:1 store, planned addresses",
        "xsched at checkpoint's peak, cpu:0 alone",
        "xsched at checkpoint's peak, cpu:0 alone, expandable segments",
        "xsched at checkpoint's peak, cpu:0 alone, planned addresses",
    ]
    assert rows["torchtune OffloadActivations"]["error"] == "skipped: CUDA streams only"
    for name, row in rows.items():
        if name != "torchtune OffloadActivations":
            assert "error" not in row, row
            assert row["time_s"] > 0 and row["peak"] > 0, name
    eager, ckpt = rows["eager PyTorch"], rows["torch.utils.checkpoint per block"]
    assert ckpt["peak"] < 0.8 * eager["peak"]  # checkpointing every block saves activations (allocator events)
    budgeted = rows["torch.compile, activation_memory_budget 0.5"]
    assert (
        budgeted["budget"] == 0.5 and budgeted["peak"] < rows["torch.compile"]["peak"]
    )  # torch's partitioner recomputes
    # the same model and data; torch.compile draws dropout's masks its own way, so the loss is close, not equal
    assert all(r["loss"] == pytest.approx(eager["loss"], rel=0.05) for k, r in rows.items() if k.startswith("torch.c"))
    for name in rows:  # with expandable segments: the allocator model's prediction beside the run (a no-op here)
        if name.endswith(", expandable segments"):
            row = rows[name]
            assert row["reserved"] is None and row["predicted_reserved"] <= row["predicted_reserved_ahead"], name
            assert row["counted_peak"] == rows[name.removesuffix(", expandable segments")]["counted_peak"], name
    for name, row in rows.items():  # planned addresses: the arena at or above its bound, what runs outside beside it
        if name.endswith(", planned addresses"):
            assert row["arena"] >= row["arena_lower_bound"] > 0 and row["arena_outside_peak"] >= 0, name
    assert (out / "run_frontier.svg").read_text().count("<svg") == 1 and "run_frontier.svg" in (
        out / "run.md"
    ).read_text()
    md = (out / "run.md").read_text()
    assert md.count("\n| ") == len(rows) + 1 and "| xsched 50%, cpu:1 store | " in md
    assert "n/a" not in md.split("| xsched 50%, cpu:1 store |")[1].splitlines()[0]  # measured on the lanes


def test_plans_train_like_eager_within_their_budgets(run):
    out, got = run
    rows = {r["plan"]: r for r in got["rows"]}
    eager_loss = rows["eager PyTorch"]["loss"]
    resident = got["facts"]["resident"]
    graph = Graph.from_dict(json.loads(gzip.open(out / "gpt2-small_n_layer_2.graph.json.gz", "rt").read()))
    for name, row in rows.items():
        if name.startswith("xsched"):
            assert row["loss"] == pytest.approx(eager_loss, rel=1e-5, abs=1e-6), name  # same dropout draws
            twin = name.endswith((", expandable segments", ", planned addresses"))
            assert (row.get("grad_err") is None) if twin else row["grad_err"] < 1e-5, name  # every parameter's
    for name in ("xsched 50%, cpu:0 alone", "xsched 50%, cpu:1 store"):
        row = rows[name]
        assert row["budget"] == eager_peak(graph) * 50 // 100
        assert row["peak"] + resident <= row["budget"], name  # the executor's bytes on cpu:0 during the steps
    alone, store = rows["xsched 50%, cpu:0 alone"], rows["xsched 50%, cpu:1 store"]
    assert alone["recomputes"] > 0 and alone["copies"] == 0 and "hidden" not in alone
    assert store["copies"] > 0 and store["lanes_s"] > 0 and store["inline_s"] > 0
    assert store["hidden"] == pytest.approx((store["inline_s"] - store["lanes_s"]) / store["copy_s"])
    ckpt = rows["torch.utils.checkpoint per block"]
    assert rows["xsched at checkpoint's peak, cpu:0 alone"]["budget"] == resident + ckpt["peak"]


def test_the_profile_is_saved_with_the_store(run):
    out, got = run
    profile = Profile.from_dict(json.loads(gzip.open(out / "gpt2-small_n_layer_2.profile.json.gz", "rt").read()))
    assert profile.graph == got["facts"]["graph"] and profile.is_store("cpu:1") and not profile.is_store("cpu:0")
    assert set(profile.copy) == {"cpu:0->cpu:1", "cpu:1->cpu:0"} == set(got["facts"]["links"])
    assert set(profile.back_to_back) == {"cpu:0"}  # calibrated back to back within --profile-s
    assert 0 < profile.profiling["back_to_back_s"] <= profile.profiling["wall_s"]


def test_checkpointed_blocks_are_restored_and_match_eager():
    from xsched import zoo

    z = zoo.build("gpt2", scale="tiny")
    model = z.model.eval()
    want = model(*z.inputs)[1]
    with torch_rows.checkpointed_blocks(model):
        assert all("forward" in vars(b) for b in model.h)
        got = model(*z.inputs)[1]
    assert not any("forward" in vars(b) for b in model.h)
    torch.testing.assert_close(got, want)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given where there is no CUDA device")
@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--device", "cuda:0"], "--device cuda:0: no such CUDA device here; --device cpu runs the reduced mode"),
        (["--device", "tpu"], "--device tpu: no such CUDA device here"),
        (["--device", "cpu", "--budgets", "50%,45"], "--budgets '50%,45': give whole percentages"),
    ],
)
def test_bad_arguments_are_one_line_errors(argv, match, capsys):
    with pytest.raises(SystemExit):
        bench.parse(argv)
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert match in err


def test_expandable_segments_rows_are_on_by_default_on_cuda_only(monkeypatch):
    assert bench.parse(["--device", "cpu"]).expandable_segments is False
    assert bench.parse(["--device", "cpu", "--expandable-segments"]).expandable_segments is True
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # parse only: nothing runs on the device
    assert bench.parse(["--device", "cuda:0"]).expandable_segments is True
    assert bench.parse(["--device", "cuda:0", "--no-expandable-segments"]).expandable_segments is False


def test_the_plain_frontier_svg_without_matplotlib():
    """The GPU image has no matplotlib: the frontier is then drawn by hand, one labelled mark per row that ran."""
    import xml.dom.minidom

    rows = [
        {"plan": "eager PyTorch", "time_s": 0.13, "peak": 14e9},
        {"plan": "xsched 45% <store>", "time_s": 0.16, "peak": 5e9},
    ]
    from gpu.memory_report import plain_svg

    svg = plain_svg([*rows, {"plan": "torchtune", "error": "skipped"}], "gpt2 & co")
    doc = xml.dom.minidom.parseString(svg)  # well-formed, labels escaped
    assert len(doc.getElementsByTagName("circle")) == 2 and "xsched 45% &lt;store&gt;" in svg


def test_predicted_reserved_is_a_range_where_the_two_ends_differ():
    from gpu.memory_report import predicted_reserved

    row = {"reserved": 100, "predicted_reserved": 75, "predicted_reserved_ahead": 104}
    assert predicted_reserved(row) == " (predicted 0.75-1.04x)"  # the GPU keeping up, the host a step ahead
    assert predicted_reserved({**row, "predicted_reserved_ahead": 75}) == " (predicted 0.75x)"
    assert predicted_reserved({"reserved": None, "predicted_reserved": 75}) == ""  # nothing measured (the CPU)
