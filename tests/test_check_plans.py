"""scripts/check_plans_unchanged.py compare: a case whose steps changed, that one record lacks, or whose error
changed is reported and fails the check; equal records pass."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

from check_plans_unchanged import compare  # noqa: E402


def write(path: Path, rows: dict) -> Path:
    path.write_text(json.dumps(rows))
    return path


def test_compare_reports_each_changed_case(tmp_path, capsys) -> None:
    before = {"g@90% eager": {"steps": "aa", "n": 3}, "g@50% eager": {"error": "BudgetError: x"}}
    a = write(tmp_path / "a.json", before)
    assert compare(a, write(tmp_path / "same.json", before)) == 0
    assert "2 cases (1 with a plan), 0 changed" in capsys.readouterr().out
    changed = {"g@90% eager": {"steps": "bb", "n": 3}, "g@50% eager": {"error": "BudgetError: y"}, "new": {}}
    assert compare(a, write(tmp_path / "b.json", changed)) == 1
    out = capsys.readouterr().out
    assert out.count("CHANGED") == 3 and "3 changed" in out
