"""scripts/plan_traffic.py: a plan's predicted step, compute, idle time and copies per direction, against a hand
count on park's plan of the hand graph of tests/test_park_home_copies.py (copies x out and back, g1 and g0 home)."""

from __future__ import annotations

import sys

import pytest
from test_park_home_copies import HOMES, late_park_before_the_last_gradient
from train_support import ROOT

from xsched.contracts.plan import Copy
from xsched.solve.heuristics.park import park_variant

sys.path.insert(0, str(ROOT / "scripts"))
from plan_traffic import plan_traffic  # noqa: E402


def test_the_prediction_is_the_hand_count() -> None:
    """Six ops on a, 1 s each; links 0.1 s + 100 B/s. The plan copies x (40 B) to b and back, g1 (200 B) and g0
    (10 B) home: out 250 B in 3 copies, 0.5 + 2.1 + 0.2 = 2.8 s; in 40 B, 0.5 s. The step is 6.3 s (the computes
    0-6 s, g0 home 6.1-6.3 s: test_park_home_copies' count), so a idles 0.3 s; b computes nothing."""
    g, profile = late_park_before_the_last_gradient()
    plan = park_variant(g, profile, {"a": 255}, HOMES, "a", "b", "graph", tuple(range(6)), 0, 0.0, 1.0, 0.0)
    assert [s for s in plan.steps if isinstance(s, Copy)] == [
        Copy("x", "a", "b"),
        Copy("g1", "a", "b"),
        Copy("x", "b", "a"),
        Copy("g0", "a", "b"),
    ]
    p = plan_traffic(g, plan, profile, "a")
    assert (p["copies_out"], p["bytes_out"], p["copies_in"], p["bytes_in"]) == (3, 250, 1, 40)
    assert p["copy_out_s"] == pytest.approx(2.8) and p["copy_in_s"] == pytest.approx(0.5)
    assert p["compute_s"] == pytest.approx(6.0) and p["step_s"] == pytest.approx(6.3)
    assert p["compute_idle_s"] == pytest.approx(0.3)
    assert p["forward_s"] + p["backward_s"] == pytest.approx(6.3)
    b = plan_traffic(g, plan, profile, "b")  # the store's side: the same copies, the other way round
    assert (b["bytes_in"], b["bytes_out"], b["compute_s"]) == (250, 40, 0.0)


def test_the_compute_is_priced_as_the_makespan_is() -> None:
    """With a back-to-back model on a (each 1 s op 0.25 s cheaper in a step), the compute column is the calibrated
    ops' time, as the simulator prices the makespan: 6 x 0.75 s, not the 6 s of the ops timed alone."""
    import dataclasses

    from xsched.contracts.profile import BackToBack

    g, alone = late_park_before_the_last_gradient()
    plan = park_variant(g, alone, {"a": 255}, HOMES, "a", "b", "graph", tuple(range(6)), 0, 0.0, 1.0, 0.0)
    profile = dataclasses.replace(alone, back_to_back={"a": BackToBack(step_s=4.5, alone_s=6.0, overhead_s=0.25)})
    p = plan_traffic(g, plan, profile, "a")
    assert p["compute_s"] == pytest.approx(6 * 0.75)
    assert p["compute_idle_s"] == pytest.approx(p["step_s"] - 6 * 0.75)
