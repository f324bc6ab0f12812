"""Plans re-planned until the caching-allocator model's reserved memory fits the budget (xsched.solve.reserved)."""

from __future__ import annotations

import pytest
from conftest import chain_graph

from xsched.allocator import replay_reserved
from xsched.contracts.profile import DeviceInfo, OpCost, Profile
from xsched.errors import BudgetError
from xsched.explain import reserved_text
from xsched.simulate import simulate
from xsched.solve.api import solve
from xsched.solve.options import SolverOptions

MiB = 1 << 20


def chain(kind: str = "cuda"):
    """Six 11 MiB activations and their gradients on one device: each value takes a 12 MiB segment of its own
    (requests of 10 MiB or more are rounded up to 2 MiB), so reserved runs ~9% over the plan's peak."""
    g = chain_graph([11 * MiB] * 6, train=True)
    return g, Profile(g.fingerprint, {"cuda:0": DeviceInfo(kind)}, {"cuda:0": {o.id: OpCost(1e-3) for o in g.ops}}, {})


def reserved(g, plan, prof) -> int:
    return replay_reserved(g, plan, prof, host_ahead=True)["cuda:0"].reserved


def test_a_plan_whose_reserved_memory_exceeds_the_budget_is_planned_again_lower() -> None:
    g, prof = chain()
    at80 = {"cuda:0": 80 * MiB}
    over = solve(g, prof, at80, method="checkpoint", options=SolverOptions(time_limit_s=10, fit_reserved=False))
    assert reserved(g, over, prof) == 86 * MiB > at80["cuda:0"]  # seven values: 7 x 12 MiB + the 2 MiB small segment
    fitted = solve(g, prof, at80, method="checkpoint", options=SolverOptions(time_limit_s=10, fit_reserved=True))
    # re-planned at 80 x 80 / 86 = 74.42 MiB: six values kept, 74 MiB reserved
    assert reserved(g, fitted, prof) == 74 * MiB <= at80["cuda:0"]
    assert "re-planned for reserved memory: cuda:0 at 74.42 MiB: fits" in fitted.solver.message
    assert simulate(g, fitted, prof).time_s > simulate(g, over, prof).time_s  # the room went to recomputes
    text = reserved_text(g, fitted, prof)  # --explain
    assert text.startswith("re-planned for reserved memory: cuda:0 at 74.42 MiB: fits. ")
    # six 12 MiB blocks (an 11 MiB request takes its whole segment: a 1 MiB tail is not split off) and x's 512 B
    assert "cuda:0: predicted reserved 74.00 MiB (fragmentation 2.00 MiB" in text


def test_no_plan_whose_reserved_memory_fits_says_not_found() -> None:
    g, prof = chain()
    # greedy keeps every value or fails: 77 MiB of values reserve 86 MiB, and below 77 MiB it finds nothing
    with pytest.raises(BudgetError, match="reserves 86.00 MiB against 80.00 MiB; not found within 3 re-plans"):
        solve(g, prof, {"cuda:0": 80 * MiB}, method="greedy", options=SolverOptions(time_limit_s=10, fit_reserved=True))


def test_devices_without_a_caching_allocator_are_not_re_planned() -> None:
    g, prof = chain("sim")  # a simulated accelerator: the plan's peak is all there is
    plan = solve(
        g, prof, {"cuda:0": 80 * MiB}, method="greedy", options=SolverOptions(time_limit_s=10, fit_reserved=True)
    )
    assert simulate(g, plan, prof).peak_bytes["cuda:0"] == 77 * MiB + 8 and "re-planned" not in plan.solver.message


def test_with_expandable_segments_the_reserved_memory_is_replayed_on_that_model() -> None:
    g, prof = chain()
    at84 = {"cuda:0": 84 * MiB}
    # the first plan keeps all seven values (77 MiB): 86 MiB reserved by default (7 segments of 12 MiB and a small
    # 2 MiB one), 82 MiB with expandable segments (four 20 MiB pages of one large segment and a 2 MiB small page)
    first = solve(g, prof, at84, method="checkpoint", options=SolverOptions(time_limit_s=10))
    assert reserved(g, first, prof) == 86 * MiB > at84["cuda:0"]
    assert replay_reserved(g, first, prof, host_ahead=True, expandable=True)["cuda:0"].reserved == 82 * MiB
    options = SolverOptions(time_limit_s=10, fit_reserved=True, expandable_segments=True)
    fitted = solve(g, prof, at84, method="checkpoint", options=options)  # fits as it is: nothing planned again
    assert fitted.steps == first.steps and "re-planned" not in fitted.solver.message


def test_with_expandable_segments_no_fitting_plan_says_so_with_that_model() -> None:
    g, prof = chain()
    # at 80 MiB: six or seven 11 MiB values take four 20 MiB pages (82 MiB with the small page), five take three (62
    # MiB), and the three re-plans (at 80 x 80 / 82 MiB, then lower in proportion) keep seven, six, six
    options = SolverOptions(time_limit_s=10, fit_reserved=True, expandable_segments=True)
    with pytest.raises(BudgetError, match="expandable segments, host a step ahead.*reserves 82.00 MiB against 80.00"):
        solve(g, prof, {"cuda:0": 80 * MiB}, method="checkpoint", options=options)
