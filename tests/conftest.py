"""Shared test fixtures: small hand-made graphs and random DAGs."""

from __future__ import annotations

import os

# Inductor in the tests (compiled plans, the torch.compile benchmark rows), set before torch reads its config and
# inherited by the scripts the tests start: CI compiles from a cold cache, where each C++ kernel is a g++ run.
# Scalar kernels (no vector ISA) skip the per-cache ISA probes (~10 s of g++) and compile in half the time; the
# tests compare compiled numbers with eager within tolerance and count allocations, which vectorizing does not
# change. One compile thread: no pool of worker processes (each importing torch) beside 2 busy cores.
# Set TORCHINDUCTOR_VEC_ISA_OK=1 to run them vectorized.
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "0")
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
# Under pytest-xdist (`-n 2`, one worker per core) each worker computes on one thread, and the scripts it starts
# inherit that: two workers of two OpenMP threads each on 2 cores spin at their barriers for cores the other holds.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from xsched.contracts.graph import Graph, Op, Value

# The external benchmark graphs ship in the repository (benchmarks/graphs/README.md gives their source).
BENCH = __import__("pathlib").Path(__file__).resolve().parents[1] / "benchmarks" / "graphs"


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def registry():
    """The solver registry, restored with its order afterwards (configurations run members in registration order;
    monkeypatch.delitem would put deleted entries back at the end)."""
    from xsched.solve.registry import SOLVERS

    saved = dict(SOLVERS)
    yield SOLVERS
    SOLVERS.clear()
    SOLVERS.update(saved)


@pytest.fixture(scope="module")
def one_thread():
    """Tiny ops on 2 shared cores: intra-op threads only add contention (6x slower here), so use one."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def chain_graph(sizes: list[int], *, train: bool = False) -> Graph:
    """x -> op0 -> v0 -> op1 -> v1 ...; with train=True a mirrored backward chain reading the forward values."""
    values = [Value("x", 8, "input")]
    ops = []
    prev = "x"
    for i, n in enumerate(sizes):
        values.append(Value(f"a{i}", n))
        ops.append(Op(f"f{i}", "t.fwd", (prev,), (f"a{i}",), "fwd"))
        prev = f"a{i}"
    outputs = [prev]
    if train:
        grad = prev
        for i in reversed(range(len(sizes))):
            src = f"a{i - 1}" if i else "x"
            values.append(Value(f"g{i}", sizes[i]))
            ops.append(Op(f"b{i}", "t.bwd", (grad, src), (f"g{i}",), "bwd"))
            grad = f"g{i}"
        outputs = [grad]
    return Graph("chain", tuple(values), tuple(ops), tuple(outputs))
