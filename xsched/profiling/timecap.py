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
    """What measuring one op takes on each device under the full and the quick policy:
        wall = a + k * input bytes + calls * t
    with t the op's time per call (measured in an earlier round, else modelled), calls what the policy makes at the
    least (warm-up, a first call, min_reps samples) plus EXTRA_CALLS of the plugin's own (workspace, energy window),
    and a (set-up, sampling that does not settle) and k (making the inputs) fitted by least squares to what the
    device took so far: a plugin does more than its policy's sampling, and only what it was seen to take is a fair
    guess."""

    EXTRA_CALLS = 2

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        # (device, quick) -> sums of the least-squares fit of y = a n + k b over measure_ops calls (n ops, b input
        # bytes, y wall less calls): [n n, n b, b b, n y, b y]
        self.sums: dict[tuple[str, bool], list[float]] = {}

    def calls(self, quick: bool) -> int:
        pol = self.policy.quick() if quick else self.policy
        return pol.warmup + 1 + pol.min_reps + self.EXTRA_CALLS

    def record(self, device: str, quick: bool, ops: int, input_bytes: int, call_s: float, wall_s: float) -> None:
        """A measure_ops call on `device`: `ops` ops with `input_bytes` of inputs and calls of `call_s` together
        took `wall_s`."""
        y = wall_s - self.calls(quick) * call_s
        n, b = float(ops), float(input_bytes)
        sums = self.sums.setdefault((device, quick), [0.0] * 5)
        for i, v in enumerate((n * n, n * b, b * b, n * y, b * y)):
            sums[i] += v

    def _fit(self, device: str, quick: bool) -> tuple[float, float] | None:
        """(a, k) >= 0 fitted to this device and policy, or None when never seen."""
        if (device, quick) not in self.sums:
            return None
        nn, nb, bb, ny, by = self.sums[(device, quick)]
        det = nn * bb - nb * nb
        if det > 1e-9 * nn * bb:
            a, k = (ny * bb - by * nb) / det, (nn * by - nb * ny) / det
            if a >= 0 and k >= 0:
                return a, k
            if a < 0 and by > 0:
                return 0.0, by / bb
        return max(0.0, ny / nn), 0.0  # one size of inputs seen so far (or k < 0): a flat overhead

    def overhead(self, device: str, quick: bool, input_bytes: int = 0) -> float:
        """Seconds per op beyond its calls: fitted under this policy; else under the other, a plus or less twice the
        difference of their sampling times (the energy window follows it); else twice the policy's sampling time."""
        fit = self._fit(device, quick)
        if fit is None:
            other = self._fit(device, not quick)
            if other is None:
                return 2 * (self.policy.quick() if quick else self.policy).max_time_s
            more = 2 * max(0.0, self.policy.max_time_s - self.policy.quick().max_time_s)
            fit = (max(0.0, other[0] - more) if quick else other[0] + more, other[1])
        return fit[0] + fit[1] * input_bytes

    def per_op(self, device: str, quick: bool, call_s: float, input_bytes: int = 0) -> float:
        """Expected wall seconds to measure an op with `input_bytes` of inputs and calls of `call_s` on `device`."""
        return self.overhead(device, quick, input_bytes) + self.calls(quick) * call_s
