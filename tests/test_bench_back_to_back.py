"""scripts/bench_back_to_back.py's one-device mode (the GPU's, run on cpu:0 at tiny sizes): the calibrated profile,
the plans run by the executor, the table, and the deadline."""

from __future__ import annotations

import importlib.util
import itertools
import re
import types
from pathlib import Path

import pytest

pytestmark = pytest.mark.usefixtures("one_thread")
TINY = ["--device", "cpu:0", "--scale", "small:n_layer=1", "--reps", "1", "--time-limit", "2", "--profile-s", "10"]


def bench():
    path = Path(__file__).resolve().parents[1] / "scripts" / "bench_back_to_back.py"
    spec = importlib.util.spec_from_file_location("bench_back_to_back", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def rows(text: str) -> dict[str, list[str]]:
    return {c[0]: c[1:] for line in text.splitlines() if line.startswith("| ") for c in [line.strip("| ").split(" | ")]}


def test_one_device_mode_calibrates_plans_and_runs_them(capsys) -> None:
    bench().main([*TINY, "--budgets", "70", "--deadline", "120"])
    out = capsys.readouterr().out
    step = float(re.search(r"cpu:0: eager step back to back ([\d.]+) ms", out).group(1))
    table = rows(out)
    measured, alone, calibrated, *_ = table["eager"]
    # the eager plan is the step the calibration measured: its calibrated prediction is that step (printed rounded),
    # or, where ops timed alone on a loaded machine took more than twice the step, the model's closest step above it
    closest = re.search(r"cpu:0: the model's closest eager step ([\d.]+) ms", out)
    assert float(calibrated.removesuffix(" ms")) == pytest.approx(
        float(closest.group(1)) if closest else step, abs=0.01
    )
    assert closest is None or float(closest.group(1)) > step
    # the ops timed alone are printed too; which of the two is larger is the machine's (and its load's), not tested
    assert float(alone.removesuffix(" ms")) > 0
    assert float(measured.removesuffix(" ms")) > 0
    checkpointed = table["auto 70%, cpu:0 alone"]  # ran, or no plan found within the limit on a loaded machine
    ran = checkpointed[0].endswith(" ms")
    assert float(checkpointed[-1]) > 0 if ran else checkpointed[0].startswith("[solve]")
    assert f"mean |predicted / measured - 1| over {1 + ran} plans" in out


def test_a_step_the_model_cannot_reach_is_said(capsys, monkeypatch) -> None:
    """A fit that cannot reach the measured step (forced here: no overhead, so each op costs its time alone) leaves
    the eager plan's calibrated prediction at the model's closest step, and the script says so."""
    monkeypatch.setattr("xsched.profiling.back_to_back.fit_overhead", lambda times, step_s: 0.0)
    bench().main([*TINY, "--budgets", "70", "--deadline", "120"])
    out = capsys.readouterr().out
    step, alone = map(
        float, re.search(r"back to back ([\d.]+) ms \(in [\d.]+ s\), sum alone ([\d.]+) ms", out).groups()
    )
    calibrated = float(rows(out)["eager"][2].removesuffix(" ms"))
    assert calibrated == pytest.approx(alone, abs=0.01)
    closest = re.search(r"cpu:0: the model's closest eager step ([\d.]+) ms", out)
    if abs(alone - step) > 0.01:  # printed rounded: the two too close to order
        assert (closest is not None) == (alone > step)
    assert closest is None or float(closest.group(1)) == pytest.approx(alone, abs=0.01)


def test_what_does_not_fit_the_deadline_is_skipped(capsys) -> None:
    """The script's clock, faked: each reading a second after the last, so the 0.5 s deadline has passed from the
    second reading on, however fast this machine captures (a real clock made this depend on load)."""
    module = bench()
    ticks = itertools.count(1.0)
    module.time = types.SimpleNamespace(perf_counter=lambda: next(ticks))
    module.main([*TINY, "--budgets", "70", "--deadline", "0.5"])
    table = rows(capsys.readouterr().out)
    assert table["eager"] == table["auto 70%, cpu:0 alone"] == ["skipped: past --deadline"]  # no cell after it


def test_bad_arguments_are_one_line_errors(capsys) -> None:
    with pytest.raises(SystemExit):
        bench().main([*TINY, "--deadline", "-1"])
    assert "--deadline and --profile-s must be positive" in capsys.readouterr().err
