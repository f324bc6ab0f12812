"""scripts/bench_compile.py on a tiny gpt2, its regions "compiled" as their fx graphs and torch.compile's rows on
aot_eager (no C++ builds: seconds): every row in its order with its phases, a --deadline that skips rows yet writes
the table and the JSON, and wrap's compiled re-plan kept as it is when its raise is off (--no-settle)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
from test_compile import chain
from test_compile_plan import _train, plain_fx, replanning_wrap

from xsched.execute import compiled_replans
from xsched.execute import segments as segments_module
from xsched.execute.compiled_memory import PLANNED_WITHIN_KEY

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import bench_compile  # noqa: E402
import bench_compile_rows  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
FAST = ["--smoke", "--iters", "1", "--compile-backend", "aot_eager", "--profile", "model", "--time-limit", "1"]
ROWS = ["--budgets", "", "--no-eager-plan"]  # torch.compile, xsched compiled at its peak, eager PyTorch: seconds
LABELS = [
    "torch.compile",
    "xsched compiled, 100% of torch.compile's peak",
    "xsched compiled, 90% of torch.compile's peak",
    "torch.compile, activation_memory_budget=0.9",
    "xsched compiled eager plan",
    "eager PyTorch",
]


def run(tmp_path: Path, monkeypatch, *args: str) -> tuple[list[dict], str, str]:
    monkeypatch.setattr(segments_module, "_inductor", plain_fx)
    md, js = tmp_path / "compile.md", tmp_path / "compile.json"
    assert bench_compile.main([*FAST, "--out", str(md), "--json", str(js), *args]) == 0
    got = json.loads(js.read_text())
    assert got["facts"]["partial"] is False
    return got["rows"], md.read_text(), js.read_text()


def test_every_row_runs_in_order_with_its_phases_the_table_written_after_each(tmp_path, monkeypatch, capsys) -> None:
    """All rows, in their order, the xsched ones with where their setup went; the table and the JSON written after
    each row, so a run killed after its second row keeps the first two (partial), and printed last."""
    seen: list[tuple[str, str]] = []
    write = bench_compile_rows.write

    def kept(lines, rows, facts, out, js):
        write(lines, rows, facts, out, js)
        seen.append((out.read_text(), js.read_text()))

    monkeypatch.setattr(bench_compile, "write", kept)
    rows, md, _ = run(tmp_path, monkeypatch, *ROWS)
    assert [r["row"] for r in rows] == [LABELS[0], LABELS[1], LABELS[-1]]
    assert not [r for r in rows if "error" in r]
    assert md in capsys.readouterr().out
    assert len(seen) == len(rows) + 1  # after each row, then the final
    second = json.loads(seen[1][1])
    assert second["facts"]["partial"] is True and [r["row"] for r in second["rows"]] == LABELS[:2]
    assert f"| {LABELS[1]} |" in seen[1][0] and "eager PyTorch" not in seen[1][0]
    ref = rows[0]
    assert ref["ref_time_s"] == ref["time_s"] and f"| {ref['peak'] / 2**20:.2f} MiB | 100% |" in md
    for r in rows[1:]:
        assert r["ref_time_s"] > 0 and r["peak"] > 0
    xsched = rows[1]  # its budget, predicted peak and phases
    (phases,) = [n for n in xsched["notes"] if n.startswith("setup ")]
    for phase in ("capture", "solve", "region compiles", "steps to settle"):
        assert phase in phases
    assert xsched["predicted"] > 0 and f"- {xsched['row']}: {phases}" in md


def test_rows_come_most_informative_first() -> None:
    order = bench_compile_rows.row_order([0.9], eager_plan=True)
    assert [bench_compile_rows.label_of(*k) for k in order] == LABELS
    assert bench_compile_rows.row_order([1.0, 0.5, 0.25], eager_plan=False) == [
        ("torch", 1.0),
        ("xsched", 1.0),
        ("xsched", 0.5),
        ("torch", 0.5),
        ("xsched", 0.25),
        ("torch", 0.25),
        ("eager", None),
    ]


def test_a_short_deadline_skips_rows_and_still_writes_the_table(tmp_path, monkeypatch) -> None:
    """Every compiled row's first setup is expected to take longer than 5 s (FIRST_SETUP_S), so each is skipped,
    said in its line; eager PyTorch (no setup) still runs, with no torch.compile to compare with."""
    assert min(bench_compile_rows.FIRST_SETUP_S.values()) > 5
    rows, md, _ = run(tmp_path, monkeypatch, "--budgets", "0.9", "--deadline", "5")
    assert [r["row"] for r in rows] == LABELS
    for r in rows[:-1]:
        assert r["error"].startswith("skipped: ") and "s left of --deadline" in r["error"]
        assert f"| {r['row']} | {r['error']} |" in md
    eager = rows[-1]
    assert "error" not in eager and eager["ref_time_s"] is None
    assert f"| eager PyTorch | {eager['time_s'] * 1e3:.1f} ms | - |" in md


def test_a_row_still_running_at_the_deadline_is_stopped_and_the_table_written(tmp_path, monkeypatch) -> None:
    """torch.compile's setup outlasting --deadline (a compile standing in that sleeps, where a first guess said it
    would fit): stopped at the deadline with a line saying so, every later row skipped, the table written."""
    monkeypatch.setitem(bench_compile_rows.FIRST_SETUP_S, ("torch", "cpu"), 0.0)
    monkeypatch.setattr(bench_compile, "compiled", lambda *a: time.sleep(60))
    rows, md, _ = run(tmp_path, monkeypatch, *ROWS, "--deadline", "2")  # a sleep run out would not say "stopped"
    assert rows[0]["error"].startswith("stopped: --deadline passed") and f"| torch.compile | {rows[0]['error']}" in md
    assert all(r["error"].startswith("skipped: ") for r in rows[1:])


def test_deadline_shortens_solves_and_expects_a_row_like_the_last(monkeypatch) -> None:
    d = bench_compile_rows.Deadline(100.0, "cuda:0")
    assert d.solve_limit(5.0) == 5.0 and d.solve_limit(20.0) == pytest.approx(10.0, abs=0.1)
    first = d.expected("xsched", 8, 5.0)
    assert first == bench_compile_rows.FIRST_SETUP_S[("xsched", "cuda")] + 5.0
    d.setup["xsched"], d.setup["torch"], d.step_s = [12.0], [20.0], 0.5
    assert d.expected("xsched", 8, 5.0) == 12.0 + 20 * 2 * 0.5
    assert d.expected("torch", 8, 5.0) == 30.0 + 20 * 2 * 0.5  # activation_memory_budget's search: 1.5x
    assert d.skip("eager", 8, 5.0) is None
    d.end -= 100.0
    assert d.skip("eager", 8, 5.0).startswith("skipped: ")  # type: ignore[union-attr]
    assert bench_compile_rows.Deadline(None, "cpu").solve_limit(20.0) == 20.0


def test_a_replan_far_under_the_budget_stays_when_raises_are_off(monkeypatch, capsys) -> None:
    """The scripted peaks of test_compile_plan's raise: the first plan over, its re-plan 30% under; with
    raise_replans off (bench_compile --no-settle) the re-plan is settled as it is, no solve within more."""
    monkeypatch.setattr(segments_module, "_inductor", plain_fx)
    eager = chain()
    w = replanning_wrap(eager)
    w.raise_replans = False
    limit = w.plan.budgets["cpu"]
    script = iter([limit + limit // 10, limit * 7 // 10])
    monkeypatch.setattr(compiled_replans, "compiled_peaks", lambda *a: {"cpu": next(script)})
    _train(w, eager, 1)  # over: solved again within less
    first = w._first
    _train(w, eager, 1)  # the re-plan, 30% under: kept
    lowered = w._first
    assert lowered is not first and lowered.replan is None and lowered.first_run is None
    assert "planning again within more" not in capsys.readouterr().err
    assert lowered.plan.extra[PLANNED_WITHIN_KEY]["cpu"] < limit == lowered.plan.budgets["cpu"]
    _train(w, eager, 1)
    assert w._first is lowered
