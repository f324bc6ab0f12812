"""Copy costs between two devices: a latency + bandwidth fit over a few sizes, and the largest values' own times,
timed by whichever device plugin knows the link, within profiling's time cap."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from xsched.contracts.graph import Value
from xsched.contracts.profile import LinkCost
from xsched.devices.base import Device, DeviceError, fit_link
from xsched.profiling import timecap
from xsched.profiling.timecap import TimeCap

VALUE_CALLS = 4  # a value's copy time costs about this many copies of it (warm-up, samples) beyond the link's setup


def copy_seconds(src: Device, dst: Device, nbytes: int, pinned: bool = True) -> float:
    """Seconds to copy nbytes from src to dst, as whichever of the two plugins knows the link says."""
    t = src.copy_seconds(dst, nbytes, outgoing=True, pinned=pinned)
    if t is None:
        t = dst.copy_seconds(src, nbytes, outgoing=False, pinned=pinned)
    if t is None:
        raise DeviceError(
            f"neither the {src.kind} nor the {dst.kind} plugin can time a copy {src.name}->{dst.name}", device=dst.name
        )
    return t


class Link:
    """One ordered device pair's copy timings: its fits (pinned and pageable host memory), then per-value times."""

    def __init__(self, a: Device, b: Device, pinned: bool) -> None:
        self.a, self.b, self.pinned = a, b, pinned
        self.modes = [pinned] if a.is_host and b.is_host else [pinned, not pinned]  # memcpy: no pinned/pageable
        self.fits: dict[bool, tuple[float, float]] = {}
        self.detail: dict[str, Any] = {}
        self.samples: dict[bool, dict[int, float]] = {}  # memory kind -> size -> seconds
        self.per_value: dict[str, float] = {}
        self.wall_s = 0.0  # the longest a single timing on this link took: the estimate for the next one

    @property
    def key(self) -> str:
        return f"{self.a.name}->{self.b.name}"

    def _timed(self, nbytes: int, pinned: bool) -> float:
        t0 = timecap.clock()
        seconds = copy_seconds(self.a, self.b, nbytes, pinned)
        self.wall_s = max(self.wall_s, timecap.clock() - t0)
        return seconds

    def time_sizes(self, sizes: Sequence[int], cap: TimeCap | None = None, until: float | None = None) -> None:
        """Time copies of each size in each memory kind, while each fits `cap` and `until` (all without a cap)."""
        for mode in self.modes:
            for n in sizes:
                if cap is not None and not cap.fits(self.wall_s, until):
                    return
                self.samples.setdefault(mode, {})[n] = self._timed(n, mode)

    def fit(self) -> None:
        """Each memory kind's latency + bandwidth fit over the sizes timed (time_sizes), and its detail."""
        self.detail["sizes"] = sorted({n for timed in self.samples.values() for n in timed})
        for mode in self.modes:
            sizes = sorted(self.samples[mode])
            seconds = [self.samples[mode][n] for n in sizes]
            self.fits[mode] = fit_link(sizes, seconds)
            entry = {"latency_s": self.fits[mode][0], "bytes_per_s": self.fits[mode][1], "seconds": seconds}
            if sizes != self.detail["sizes"]:
                entry["sizes"] = sizes  # the time cap left some out
            self.detail["pinned" if mode else "pageable"] = entry

    def _value_s(self, value: Value) -> float:
        """Expected wall seconds to time one value's copy: the longest timing so far plus VALUE_CALLS copies of it."""
        latency, bandwidth = self.fits[self.pinned]
        return self.wall_s + VALUE_CALLS * (latency + value.nbytes / bandwidth)

    def values_s(self, values: Sequence[Value]) -> float:
        """Expected wall seconds of time_values(values) (0 on a modelled link, which times none)."""
        return 0.0 if self.a.simulated or self.b.simulated else sum(self._value_s(v) for v in values)

    def time_values(self, values: Sequence[Value], cap: TimeCap) -> None:
        """Measured copy times of `values` (largest first) while each fits the cap; a modelled link is exactly its
        fit and times none. A value left out is costed by the fit (Profile.copy_time)."""
        if self.a.simulated or self.b.simulated:
            return
        for v in values:
            if not cap.fits(self._value_s(v)):
                break
            self.per_value[v.id] = self._timed(v.nbytes, self.pinned)

    def cost(self) -> LinkCost:
        latency, bandwidth = self.fits[self.pinned]
        return LinkCost(latency, bandwidth, dict(self.per_value))


def measure_links(
    links: Sequence[Link], sizes: Sequence[int], cap: TimeCap | None = None, until: float | None = None
) -> None:
    """Fit every link: first the smallest and the largest size on each (a fit needs two: timed whatever the cap),
    then the others while they fit before `cap` and `until` (seconds after its start)."""
    ends, middle = sorted({min(sizes), max(sizes)}), sorted(sizes)[1:-1]
    for link in links:
        link.time_sizes(ends)
    for link in links:
        link.time_sizes(middle, cap, until)
    for link in links:
        link.fit()


def measure_link(
    a: Device, b: Device, sizes: Sequence[int], largest: Sequence[Value], pinned: bool
) -> tuple[LinkCost, dict[str, Any]]:
    """The copy cost a->b (fit over `sizes` and the `largest` values' own times) and its detail for extra["links"]."""
    link = Link(a, b, pinned)
    measure_links([link], sizes)
    link.time_values(largest, TimeCap(None))
    return link.cost(), link.detail
