"""Profiling's overall time cap: the deadline of one run, and what a device's next op is expected to take."""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from xsched.devices.base import Policy
from xsched.errors import ProfileError

# Every duration the cap counts is read from this clock (tests replace it with a fake clock that devices advance).
clock: Callable[[], float] = time.perf_counter


class TimeCap:
    """The deadline of one profiling run: `max_total_s` seconds after it started (None: no deadline)."""

    def __init__(self, max_total_s: float | None) -> None:
        if max_total_s is not None and not (isinstance(max_total_s, (int, float)) and 0 <= max_total_s < math.inf):
            raise ProfileError(f"max_total_s must be a finite number of seconds >= 0, got {max_total_s!r}")
        self.max_total_s = max_total_s
        self.start = clock()

    @property
    def capped(self) -> bool:
        return self.max_total_s is not None

    def spent(self) -> float:
        return clock() - self.start

    def left(self, until: float | None = None) -> float:
        """Seconds to the deadline, or to `until` (seconds after the start) when that is earlier; inf without cap."""
        end = math.inf if self.max_total_s is None else self.max_total_s
        if until is not None:
            end = min(end, until)
        return end - self.spent()

    def fits(self, estimate_s: float, until: float | None = None) -> bool:
        """Whether work expected to take `estimate_s` ends before the deadline (and before `until`)."""
        return estimate_s <= self.left(until)


class OpWalls:
    """What measuring one op takes on each device under the full and the quick policy: overhead + calls * t, with t
    the op's time per call (measured in an earlier round, else modelled) and calls what the policy makes at the
    least (warm-up, a first call, min_reps samples) plus EXTRA_CALLS of the plugin's own (workspace, energy window).
    The overhead (inputs, set-up, sampling that does not settle) is what the device took beyond its calls so far:
    a plugin does more than its policy's sampling, and only what it was seen to take is a fair guess."""

    EXTRA_CALLS = 2

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self.totals: dict[tuple[str, bool], list[float]] = {}  # (device, quick) -> [wall s, ops' call s, ops]

    def calls(self, quick: bool) -> int:
        pol = self.policy.quick() if quick else self.policy
        return pol.warmup + 1 + pol.min_reps + self.EXTRA_CALLS

    def record(self, device: str, quick: bool, ops: int, call_s: float, wall_s: float) -> None:
        """A measure_ops call on `device`: `ops` ops whose calls took `call_s` together took `wall_s`."""
        total = self.totals.setdefault((device, quick), [0.0, 0.0, 0])
        total[0] += wall_s
        total[1] += call_s
        total[2] += ops

    def _overhead_seen(self, device: str, quick: bool) -> float | None:
        wall, call_s, ops = self.totals.get((device, quick), (0.0, 0.0, 0))
        return max(0.0, (wall - self.calls(quick) * call_s) / ops) if ops else None

    def overhead(self, device: str, quick: bool) -> float:
        """Seconds per op beyond its calls: seen under this policy; else seen under the other, plus or less twice the
        difference of their sampling times (the energy window follows it); else twice the policy's sampling time."""
        seen = self._overhead_seen(device, quick)
        if seen is not None:
            return seen
        other = self._overhead_seen(device, not quick)
        if other is None:
            return 2 * (self.policy.quick() if quick else self.policy).max_time_s
        more = 2 * max(0.0, self.policy.max_time_s - self.policy.quick().max_time_s)
        return max(0.0, other - more) if quick else other + more

    def per_op(self, device: str, quick: bool, call_s: float) -> float:
        """Expected wall seconds to measure an op whose call takes `call_s` on `device`."""
        return self.overhead(device, quick) + self.calls(quick) * call_s
