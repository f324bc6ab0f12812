"""`xsched demo`: the showcase runs end to end on a small model, writes its report and checks the trained plan."""

from __future__ import annotations

import pytest

from xsched.demo import DemoSettings, run_demo


def test_demo_writes_the_report_and_trains_a_plan_like_eager(tmp_path) -> None:
    pytest.importorskip("matplotlib")
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
        profile_s=2.0,
        progress=False,
    )
    assert run_demo(settings, say=lines.append) == 0
    text = "\n".join(lines)
    html = tmp_path / "demo" / "report.html"
    assert html.exists() and str(html.resolve()) in text
    assert "Budget sweep" in html.read_text() and (tmp_path / "demo" / "plan.json").exists()
    assert "max |difference| from eager 0" in text
    assert "losses and parameters at every step equal eager PyTorch's" in text
