"""`xsched train` times each stage of its setup (issue 30: 91 s at 8 GiB, 27 s at 16 GiB, not said where): the
result's setup_stages, in the order they ran, within setup_s; the end line and the JSON lines' end event say them;
a cached plan's run spends less in its plan stage than the run that solved it."""

from __future__ import annotations

import io
import json

import pytest

from xsched.train import TrainConfig, train
from xsched.train.progress import Bar, JsonLines

pytestmark = pytest.mark.usefixtures("one_thread")
STAGES = ["model", "loss outputs", "capture", "plan", "wrap", "optimizer", "pin", "restore"]


def test_setup_stages_are_timed_and_reported(tmp_path) -> None:
    cache = str(tmp_path / "cache")
    config = TrainConfig(
        "zoo:gpt2", {"cpu": "100%"}, steps=1, scale="tiny", profile="model", cache_dir=cache, method="eager"
    )
    out = io.StringIO()
    first = train(config, Bar(out))
    assert list(first.setup_stages) == STAGES
    assert all(s >= 0 for s in first.setup_stages.values())
    assert sum(first.setup_stages.values()) <= first.setup_s
    line = next(x for x in out.getvalue().splitlines() if x.startswith("trained steps"))
    assert "(setup " in line and ": model " in line and ", plan " in line and ", restore " in line, line
    lines = io.StringIO()
    again = train(config, JsonLines(lines))  # the plan cached by the first run: found, not solved
    end = [json.loads(x) for x in lines.getvalue().splitlines() if x.startswith("{")][-1]
    assert end["event"] == "end" and list(end["setup_stages"]) == STAGES
    assert again.plan_reused and not first.plan_reused
