"""Profiling's overall time cap (max_total_s) on a fake clock: devices that take a known time per op, per call and
per copy advance it, so the cap is checked against what the work cost, not against this machine's load."""

from __future__ import annotations

import statistics

import pytest
from conftest import chain_graph

from xsched.contracts.profile import OpCost
from xsched.devices import get_device
from xsched.devices.base import DEFAULT_POLICY, Device, Measurement, Policy, repeat_until_stable
from xsched.devices.sim import op_io_bytes, roofline
from xsched.profiling import timecap
from xsched.profiling.fallback import roofline_costs
from xsched.profiling.measure import profile_graph, signature_groups
from xsched.profiling.model import modelled_op_seconds
from xsched.profiling.timecap import OpWalls

GRAPH = chain_graph([4096 * (i + 1) for i in range(30)], train=True)  # 60 ops, each its own signature (GPT-2: 60)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock(monkeypatch):
    c = FakeClock()
    monkeypatch.setattr(timecap, "clock", c)
    return c


class Slow(Device):
    """Each op costs `setup_s` (its inputs) and each call `call_s` plus its bytes at 1 GB/s, on the fake clock,
    through repeat_until_stable as a real device (warm-up and samples as the policy says); each copy of n bytes
    `copy_setup_s` plus ten copies at 10 GB/s."""

    kind = "slow"
    memory_bytes = 1 << 30
    description = "a device on a fake clock"

    def __init__(self, name, clock, call_s=5e-3, setup_s=0.02, copy_setup_s=0.01):
        super().__init__(name)
        self.clock, self.call_s, self.setup_s, self.copy_setup_s = clock, call_s, setup_s, copy_setup_s
        self.measured: list[str] = []
        self.copies = 0

    def fingerprint_parts(self):
        return {}

    def measure_op(self, graph, op, policy=DEFAULT_POLICY):
        self.measured.append(op.id)
        self.clock.advance(self.setup_s)
        per_call = self.call_s + op_io_bytes(graph, op) / 1e9

        def timed(call, n):
            t0 = self.clock()
            for _ in range(n):
                call()
            return self.clock() - t0

        samples = repeat_until_stable(lambda: self.clock.advance(per_call), policy, timed)
        return Measurement(statistics.median(samples), 0.0, "model", 0, len(samples))

    def copy_seconds(self, other, nbytes, *, outgoing, pinned=True):
        self.copies += 1
        t = 1e-5 + nbytes / 1e10
        self.clock.advance(self.copy_setup_s + 10 * t)
        return t


class Interleaving(Slow):
    """The same costs, but measure_ops is its own: profiling hands it chunks of ops."""

    kind = "interleaving"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.chunks: list[int] = []

    def measure_ops(self, graph, ops, policy=DEFAULT_POLICY):
        self.chunks.append(len(ops))
        return [self.measure_op(graph, op, policy) for op in ops]


class Store(Device):
    """Holds values; measuring an op here is a test failure."""

    kind = "store"
    memory_bytes = 1 << 40
    description = "a store"

    def fingerprint_parts(self):
        return {}

    def measure_op(self, graph, op, policy=DEFAULT_POLICY):
        raise AssertionError("an op was measured on a store")


def _uncapped_s(clock, device_kind=Slow, **kwargs) -> float:
    t0 = clock()
    profile_graph(GRAPH, [device_kind("slow", clock)], progress=False, **kwargs)
    return clock() - t0


@pytest.mark.parametrize("share", [0.0, 0.05, 0.3, 0.6, 0.9])
@pytest.mark.parametrize("kind", [Slow, Interleaving])
def test_the_cap_holds_within_ten_percent(clock, share, kind):
    assert len(signature_groups(GRAPH)) == 60
    full = _uncapped_s(clock, kind)
    assert full > 5.0  # 60 ops, 3 rounds, 7 calls each: several seconds uncapped
    cap = share * full
    dev = kind("slow", clock)
    t0 = clock()
    p = profile_graph(GRAPH, [dev], max_total_s=cap, progress=False)
    spent = clock() - t0
    assert spent <= 1.1 * cap + 1e-9, (spent, cap)
    assert p.profiling["wall_s"] == pytest.approx(spent, abs=1e-3)
    ops = {o.id for o in GRAPH.ops}
    assert set(p.compute["slow"]) == ops  # every op has a cost, measured or modelled
    modelled = set(p.extra.get("modelled_ops", {}).get("slow", []))
    assert modelled == ops - set(dev.measured)
    if share >= 0.3:
        assert len(set(dev.measured)) == len(ops)  # 30% of the time measures every op once (quick policy)
    if share >= 0.6:
        assert len(dev.measured) > len(ops)  # and later rounds too
    if share == 0.0:
        assert modelled == ops and p.profiling["modelled_ops"] == {"slow": len(ops)}
    if kind is Interleaving and 0 < share:
        assert max(dev.chunks) > 1  # chunks of several ops, not one at a time


def test_the_cap_counts_the_copies_to_a_store(clock):
    compute, store = Slow("slow", clock, copy_setup_s=0.05), Store("store")
    t0 = clock()
    profile_graph(GRAPH, [compute], stores=[store], progress=False)
    uncapped, copies = clock() - t0, compute.copies
    assert copies == 2 * (2 * 5 + 8)  # both ways: 5 sizes, pinned and pageable, and the 8 largest values
    for share in (0.1, 0.3):
        compute = Slow("slow", clock, copy_setup_s=0.05)
        t0 = clock()
        p = profile_graph(GRAPH, [compute], stores=[Store("store")], max_total_s=share * uncapped, progress=False)
        assert clock() - t0 <= 1.1 * share * uncapped
        assert set(p.copy) == {"slow->store", "store->slow"} and set(p.compute["store"]) == set()


def test_a_cap_below_the_link_fits_still_fits_each_link(clock):
    """The smallest and the largest size per link and memory kind are timed whatever the cap (a fit needs two);
    nothing else is."""
    dev = Slow("slow", clock)
    p = profile_graph(GRAPH, [dev], stores=[Store("store")], max_total_s=0.0, progress=False)
    assert dev.copies == 2 * 2 * 2 and not dev.measured
    assert p.extra["links"]["slow->store"]["sizes"] == [4 << 10, 32 << 20]
    assert p.link("slow", "store").per_value == {} and p.link("store", "slow").bytes_per_s > 0


def test_unmeasured_ops_get_the_roofline_of_what_the_device_reached():
    """Hand counts: two measured ops at 1 GB/s (2 us and 8 us) -> L = 2 us, B = 1 GB/s, no FLOPs (uncallable ops)."""
    g = GRAPH
    a, b, c = g.ops[0], g.ops[1], g.ops[40]
    ba, bb, bc = (op_io_bytes(g, o) for o in (a, b, c))
    measured = {a.id: OpCost(ba / 1e9, 3 * ba / 1e9), b.id: OpCost(bb / 1e9, 3 * bb / 1e9)}
    got = roofline_costs(g, Slow("slow", FakeClock()), measured, [c.id])[c.id]
    assert got.time_s == pytest.approx(min(ba, bb) / 1e9 + bc / 1e9)
    assert got.energy_j == pytest.approx(3 * got.time_s) and got.workspace_bytes == 0  # the measured power, 3 W
    # nothing measured: the device's spec if it has one, else bytes over the kind's modelled bandwidth
    sim = get_device("sim:h100")
    assert roofline_costs(g, sim, {}, [c.id])[c.id].time_s == pytest.approx(roofline(sim.spec, 0.0, bc, None)[0])
    assert roofline_costs(g, Slow("slow", FakeClock()), {}, [c.id])[c.id].time_s == pytest.approx(
        modelled_op_seconds(g, c.id, "slow")
    )


def test_the_full_policy_while_the_rest_still_fits_at_the_quick_one():
    from xsched.profiling.rounds import _next_unit

    walls = OpWalls(Policy())  # calls: 2 + 1 + 5 + 2 = 10 at the full policy, 1 + 1 + 1 + 2 = 5 at the quick one
    assert (walls.calls(False), walls.calls(True)) == (10, 5)
    walls.record("d", False, 2, 0, 0.02, 1.2)  # 2 ops of 10 ms: 0.2 s of calls, 0.5 s overhead each
    walls.record("d", True, 1, 0, 0.01, 0.15)  # 0.05 s of calls, 0.1 s overhead
    assert walls.per_op("d", False, 0.01) == pytest.approx(0.6) and walls.per_op("d", True, 0.01) == pytest.approx(0.15)
    ten = [(0.01, 0)] * 10
    assert _next_unit(walls, "d", ten, 0.6 + 9 * 0.15, True) == (False, 1)
    assert _next_unit(walls, "d", ten, 0.6 + 9 * 0.15 - 0.01, True) == (True, 1)
    assert _next_unit(walls, "d", ten, 0.14, True) is None
    # a larger op is expected to take longer: 1 s calls, 10 s at the full policy
    assert _next_unit(walls, "d", [(1.0, 0), *ten[1:]], 5.2, True) == (True, 1)
    assert _next_unit(walls, "d", [(1.0, 0), *ten[1:]], 5.0, True) is None  # (measure_rounds skips it: fallback)
    # an interleaving device: chunks of about half the time left, as many full ops as leave the rest time
    twenty = [(0.01, 0)] * 20
    assert _next_unit(walls, "d", twenty, 5.0, False) == (False, 4)  # 4 full (2.4 s), 16 quick: 4.8 s
    assert _next_unit(walls, "d", twenty, 4.0, False) == (False, 2)  # 3 full would leave 2.2 s for 17 quick
    assert _next_unit(walls, "d", [(0.01, 0)] * 100, 4.0, False) == (True, 13)  # not one full: 2 s of quick ones
    # never seen: twice the sampling time; seen under the other policy only: plus or less twice the difference
    fresh = OpWalls(Policy())
    assert fresh.overhead("e", False) == 2 * Policy().max_time_s and fresh.overhead("e", True) == 2 * 0.05
    fresh.record("e", True, 2, 0, 0.0, 0.2)
    assert fresh.overhead("e", False) == pytest.approx(0.1 + 2 * (0.25 - 0.05))


def test_making_the_inputs_is_fitted_per_byte():
    """wall = a + k * input bytes + calls * t, least squares over what the device took: hand-made observations."""
    walls = OpWalls(Policy())
    a, k = 0.01, 1e-9  # 10 ms per op, 1 s per GB of inputs
    for ops, nbytes in ((1, 0), (3, 6 << 20), (2, 400 << 20)):
        walls.record("d", True, ops, nbytes, 0.001, ops * a + k * nbytes + walls.calls(True) * 0.001)
    assert walls.overhead("d", True, 1 << 30) == pytest.approx(a + k * (1 << 30))
    assert walls.overhead("d", False, 0) == pytest.approx(a + 2 * (0.25 - 0.05))  # the full policy: k shared


def test_the_gpu_check_script_prints_wall_over_cap(tmp_path, capsys):
    """scripts/bench_profile_cap.py (the check to run on a GPU): a row per cap with wall / cap, on logical CPUs."""
    import importlib.util
    import sys
    from pathlib import Path

    import torch

    from xsched.capture.torch import capture

    spec = importlib.util.spec_from_file_location(
        "bench_profile_cap", Path(__file__).resolve().parents[1] / "scripts" / "bench_profile_cap.py"
    )
    bench = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    sys.modules["bench_profile_cap"] = bench
    spec.loader.exec_module(bench)  # type: ignore[union-attr]
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    path = tmp_path / "g.json"
    capture(model, (torch.randn(8, 16),)).save(path)
    bench.main([str(path), "--devices", "cpu:0,threads=1", "--store", "cpu:1", "--caps", "0.5,1"])  # rc: wall time
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| 0.5 s |") or line.startswith("| 1 s |")]
    assert len(rows) == 2 and "worst wall / cap:" in out and "stores cpu:1" in out
