"""The re-plans of a wrapped model's compiled plan after its first run, as a mixin of `XschedModule`: over its
budget, its overrunning regions split and measured again, then solved again within less; a re-plan far under it,
once more within more, going back if that overruns.
The rules for the budgets are `compiled_memory`'s; this holds the sequence of plans per input signature."""

from __future__ import annotations

import sys
from typing import Any

from xsched.budgets import format_bytes
from xsched.errors import BudgetError
from xsched.execute.compiled_memory import (
    MAX_SPLITS,
    lowered_budgets,
    over_budget,
    raised_budgets,
    split_overruns,
    uncompile_overruns,
    wasted_room,
    with_compiled_peaks,
)
from xsched.execute.compiled_walk import compiled_peaks
from xsched.execute.wrap_run import Compiled
from xsched.execute.wrap_signature import GRADED_MODES

# Re-plans of a compiled plan over its budget before its overrunning regions run uncompiled: the excess is the first
# plan's, and a re-plan's regions allocate otherwise again (on gpt2 small, CPU, one re-plan fits in some runs only)
MAX_REPLANS = 2


class CompiledReplans:
    """`_measured` is a compiled plan's first-run hook; `_replanned` and `_gone_back` run at the next call. The host
    class provides `compiled` (key -> Compiled), `_first`, `_compile` and `_move_to_homes`."""

    compiled: dict[tuple, Compiled]
    # a re-plan far under its budget is solved once more within more (a solve and its regions' compiles again);
    # False keeps it as it is: a caller who wants one figure soon (scripts/bench_compile.py --no-settle)
    raise_replans: bool = True
    _first: Compiled
    _compile: Any
    _move_to_homes: Any

    def _measured(self, c: Compiled) -> None:
        """After a compiled plan's first run: a device whose compiled peak went over its budget gets its
        overrunning regions split in two (`split_overruns`), measured again at the next call: the regions' real
        allocations differ from the per-op count the solver planned with, and a smaller region allocates closer to
        it (one compute, as counted). After MAX_SPLITS rounds still over, the plan is solved again at the next
        call, within the budget it was solved within less the excess. A re-plan far under its limit is settled and
        solved once more within more (`raised_budgets`), and that one, if over, gives way to it; otherwise, or
        after MAX_REPLANS, the plan is settled."""
        segments = c.executor.segments
        peaks = compiled_peaks(c.graph, c.plan, segments.peaks)
        over = over_budget(peaks, c.limits)
        say = ", ".join(f"{d} {format_bytes(peaks[d])} over {format_bytes(c.limits[d])}" for d in over)
        if over and c.fallback is not None:  # solved within more than a plan that fit, and over: back to that one
            c.back_to = c.fallback
            print(f"xsched: the compiled plan peaked at {say}: back to the plan before it", file=sys.stderr)
            return
        if over and segments.split_rounds < MAX_SPLITS and split_overruns(c.graph, c.plan, segments, c.limits):
            c.first_run = self._measured  # the next call measures the parts
            print(f"xsched: the compiled plan peaked at {say}: its regions over the budget split", file=sys.stderr)
            return
        if not over:
            again = self.raise_replans and c.fallback is None and c.replans < MAX_REPLANS
            room = wasted_room(c.plan, peaks, c.limits) if again else {}
            if room:  # a re-plan far under its limit: once more within more, this plan kept to go back to
                c.replan = raised_budgets(c.plan, room)
                say = ", ".join(f"{d} {format_bytes(peaks[d])} of {format_bytes(c.limits[d])}" for d in room)
                print(f"xsched: the compiled re-plan peaked at {say}: planning again within more", file=sys.stderr)
            self._settled(c)
            return
        c.replan = lowered_budgets(c.plan, over)
        c.plan = with_compiled_peaks(c.plan, peaks)
        print(f"xsched: the compiled plan peaked at {say}: planning again within less", file=sys.stderr)

    def _settled(self, c: Compiled) -> None:
        """The plan's predicted peak becomes its compiled regions' (as measured); a region over its budget runs
        uncompiled, with a notice (a re-plan that still overruns, a given plan, a re-plan that failed)."""
        c.plan = with_compiled_peaks(c.plan, uncompile_overruns(c.graph, c.plan, c.executor.segments, c.limits))

    def _replanned(self, key: tuple, c: Compiled, inputs: tuple) -> Compiled:
        """The plan of `key` solved again within `c.replan`; where none exists, `c` with its overrunning regions
        uncompiled."""
        # `c` within its limits (its peak the measured one): the re-plan is within more, and `c` is kept to go back to
        raised = c if not over_budget(c.plan.predicted.peak_bytes, c.limits) else None
        try:
            new = self._compile(
                key,
                inputs,
                inference=key[0] not in GRADED_MODES,
                limits=c.limits,
                replans=c.replans + 1,
                fallback=raised,
            )
        except BudgetError as e:
            which = "raised" if raised else "lowered"
            print(f"xsched: no plan within the {which} budgets ({e.detail.splitlines()[0]})", file=sys.stderr)
            c.replan = None
            self.compiled[key] = c
            self._settled(c)
            return c
        if c is self._first:
            self._first = new
            self._move_to_homes(new)
        return new

    def _gone_back(self, key: tuple, c: Compiled) -> Compiled:
        """The plan `c` was solved to replace (it fit), in its place for good, now that `c` overran."""
        back = c.back_to
        assert back is not None
        back.replan = None
        self.compiled[key] = back
        if c is self._first:
            self._first = back
            self._move_to_homes(back)
        return back
