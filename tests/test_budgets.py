"""Budget strings: units, percentages of the eager peak, and errors."""

from __future__ import annotations

import pytest

from xsched.budgets import format_bytes, parse_budget, parse_budgets
from xsched.errors import BudgetError


@pytest.mark.parametrize(
    ("spec", "expected"),
    [("4GiB", 4 * 2**30), ("16GB", 16 * 10**9), ("1048576", 2**20), (123, 123), ("1.5 MiB", 3 * 2**19), ("2kb", 2000)],
)
def test_units(spec, expected):
    assert parse_budget(spec) == expected


def test_percent_of_eager_peak_is_computed_once():
    calls = []

    def peak():
        calls.append(1)
        return 1000

    assert parse_budgets({"cpu": "50%", "cuda:0": "25%", "x": "1KiB"}, peak) == {"cpu": 500, "cuda:0": 250, "x": 1024}
    assert len(calls) == 1


@pytest.mark.parametrize("spec", ["lots", "4 parsecs", "-3", True, -1])
def test_bad_budgets(spec):
    with pytest.raises(BudgetError):
        parse_budget(spec, device="cpu")


def test_percent_without_peak():
    with pytest.raises(BudgetError, match="eager peak") as e:
        parse_budget("50%", device="cuda:0")
    assert e.value.device == "cuda:0"


def test_format_bytes():
    assert format_bytes(512) == "512 B"
    assert format_bytes(3 * 2**30) == "3.00 GiB"
