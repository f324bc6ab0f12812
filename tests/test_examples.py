"""The examples run as documented, and the wrapped training loop matches eager PyTorch step for step."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def test_train_wrapped_matches_eager():
    out = subprocess.run(
        [sys.executable, str(EXAMPLES / "train_wrapped.py"), "5"],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    ).stdout
    pairs = re.findall(r"xsched loss ([0-9.]+)\s+eager loss ([0-9.]+)", out)
    assert len(pairs) == 5
    assert all(a == b for a, b in pairs)
    assert "within" in out  # the plan's peak is reported within its budget
