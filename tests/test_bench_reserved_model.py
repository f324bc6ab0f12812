"""scripts/bench_reserved_model.py's predictions: the allocator model's replays of a plan, default and expandable."""

from __future__ import annotations

import sys
from pathlib import Path

from test_allocator_expandable import merge_graph

from xsched.solve.reference import eager_plan

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import bench_reserved_model as bench  # noqa: E402

MiB = 1 << 20


def test_predictions_replay_the_plan_with_each_setting() -> None:
    g = merge_graph()
    got = bench.predictions(g, eager_plan(g, "cuda:0"), None)
    assert set(got) == {("side", False), ("side", True)}  # nothing copied: one copy pool
    # counted by hand in tests/test_allocator_expandable.py: 48 MiB by default, 42 MiB with expandable segments;
    # the step: 40 MiB reserved above x's 2 MiB for a peak of a and b together, 22 MiB
    assert [got["side", grown][0].reserved for grown in (False, True)] == [48 * MiB, 42 * MiB]
    assert bench.cell(*got["side", True]) == f"{42 * MiB / got['side', True][0].plan_peak:.3f} (40 MiB for 22)"


def test_explain_row_is_the_hand_counted_arena() -> None:
    """--explain's row on tests/test_explain_arena.py's hand plan: 20 MiB over a 12,000,000 B peak, the arena 8,000,512
    B (7.6 MiB) by greedy and by CP-SAT (proven), d's 2,000,384 B outside it."""
    from test_explain_arena import hand_graph, hand_plan

    g = hand_graph()
    cells = bench.explain_row(g, hand_plan(g), None, "hand").split(" | ")
    assert cells[:4] == ["| hand", f"{20 * MiB / 12_000_000:.3f}", "8", "2"]
    assert cells[5].startswith("8 (optimal, ")
