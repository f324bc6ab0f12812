"""cuBLAS's workspace in the allocator model (xsched.allocator.replay.cublas_workspace): one block per compute stream
that runs a matmul, there before the step in every mode, sized as PyTorch sizes it; counted by hand."""

from __future__ import annotations

from dataclasses import replace

from test_allocator_expandable import merge_graph, plan_of

from xsched.allocator import replay_reserved
from xsched.allocator.replay import cublas_workspace
from xsched.contracts.graph import Graph
from xsched.contracts.plan import Compute, Free
from xsched.contracts.profile import DeviceInfo, Profile

MiB = 1 << 20
D = "cuda:0"


def matmul_graph() -> Graph:
    """merge_graph with g an aten.mm (the rest unknown ops)."""
    g = merge_graph()
    return Graph(
        g.name, g.values, tuple(replace(o, target="aten.mm.default") if o.id == "g" else o for o in g.ops), g.outputs
    )


def h100(graph: Graph, capability: str | None = "9.0") -> Profile:
    parts = {"capability": capability} if capability else {}
    return Profile(graph.fingerprint, {D: DeviceInfo("cuda", extra={"fingerprint_parts": parts})}, {D: {}})


STEPS = [Compute("f", D), Compute("g", D), Free("a", D), Compute("k", D), Free("b", D), Compute("h", D)]
STEPS += [Compute("m", D), Free("s", D), Free("c", D)]


def test_a_measured_h100_running_a_matmul_keeps_32_mib_before_the_step(monkeypatch) -> None:
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    g = matmul_graph()
    plan = plan_of(g, STEPS)
    assert cublas_workspace(plan, g, h100(g), D) == 32 * MiB
    assert cublas_workspace(plan, g, h100(g, "8.0"), D) == (8 * 1024 + 128) * 1024  # 4096 KiB x 2 + 16 KiB x 8
    # by hand (tests/test_allocator_expandable.py): 48 MiB reserved by default, 42 with expandable segments, 2 of
    # them before the step; the workspace adds its own 32 MiB segment before the step in both
    for grown, alone in ((False, 48), (True, 42)):
        r = replay_reserved(g, plan, h100(g), expandable=grown)[D]
        assert (r.reserved, r.base_reserved, r.step_reserved) == ((alone + 32) * MiB, 34 * MiB, (alone - 2) * MiB)


def test_the_workspace_follows_cublas_workspace_config(monkeypatch) -> None:
    g = matmul_graph()
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:2:16:8")
    assert cublas_workspace(plan_of(g, STEPS), g, h100(g), D) == (8 * 1024 + 128) * 1024
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
    assert cublas_workspace(plan_of(g, STEPS), g, h100(g), D) == 128 * 1024


def test_no_workspace_without_a_matmul_or_a_measured_gpu() -> None:
    g = merge_graph()  # no cuBLAS op
    assert cublas_workspace(plan_of(g, STEPS), g, h100(g), D) == 0
    m = matmul_graph()
    assert cublas_workspace(plan_of(m, STEPS), m, h100(m, None), D) == 0  # a simulated GPU: no capability
    assert cublas_workspace(plan_of(m, STEPS), m, None, D) == 0
    assert replay_reserved(m, plan_of(m, STEPS), h100(m, None))[D].reserved == 48 * MiB
