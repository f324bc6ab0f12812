"""scripts/bench_hf.py's CPU mode runs end to end (tiny sizes, modelled costs): a row per model with its ratios, and
the wrapped step equal to eager."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")


def test_bench_hf_quick(capsys) -> None:
    path = Path(__file__).resolve().parents[1] / "scripts" / "bench_hf.py"
    spec = importlib.util.spec_from_file_location("bench_hf", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert (
        bench.main(["--quick", "--method", "checkpoint", "--steps", "1", "--warmup", "0", "--models", "llama,bert"])
        == 0
    )
    out = capsys.readouterr().out
    rows = {
        r[0]: r for r in (re.split(r"\s*\|\s*", line.strip("| ")) for line in out.splitlines()) if r[0] in bench.MODELS
    }
    assert set(rows) == {"llama", "bert"}
    for r in rows.values():
        assert all(float(x) > 0 for x in r[3:6])  # the three ratios
        loss, grad = (float(x) for x in r[8].split(" / "))
        assert loss <= 1e-5 and grad <= 1e-5
