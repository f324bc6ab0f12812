"""`xsched demo`: the showcase runs end to end on a small model, writes its report and checks the trained plan."""

from __future__ import annotations

import pytest

import xsched.execute.back_to_back as b2b
from xsched.demo import DemoSettings, run_demo
from xsched.devices.base import Policy


def test_demo_writes_the_report_and_trains_a_plan_like_eager(tmp_path, monkeypatch) -> None:
    pytest.importorskip("matplotlib")
    # the ops measured quickly (one sweep, few samples) and two small copies: done well within the cap, its one-time
    # set-up included, so the eager steps back to back fit in what it leaves
    real, quick = b2b.profile_graph, {"rounds": 1, "copy_sizes": (1 << 10, 1 << 12), "policy": Policy().quick()}
    monkeypatch.setattr(b2b, "profile_graph", lambda *a, **k: real(*a, **{**k, **quick}))
    lines: list[str] = []
    settings = DemoSettings(
        "mlp_mixer",
        "tiny",
        "sim:rtx4090",
        "90%",
        str(tmp_path / "demo"),
        time_limit_s=0.5,
        solve_s=3.0,
        points=2,
        steps=2,
        warmup=1,
        profile_s=10.0,
        progress=False,
    )
    assert run_demo(settings, say=lines.append) == 0
    text = "\n".join(lines)
    html = tmp_path / "demo" / "report.html"
    assert html.exists() and str(html.resolve()) in text
    assert "Budget sweep" in html.read_text() and (tmp_path / "demo" / "plan.json").exists()
    assert "max |difference| from eager 0" in text
    assert "losses and parameters at every step equal eager PyTorch's" in text
    assert "eager steps back to back on cpu" in text  # calibrated as wrap and `xsched train` measure
