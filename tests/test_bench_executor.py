"""The executor benchmark's memory measurement (scripts/bench_executor.py step_memory) against references."""

from __future__ import annotations

import copy
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from xsched.execute.wrap import wrap

_spec = importlib.util.spec_from_file_location(
    "bench_executor", Path(__file__).resolve().parents[1] / "scripts" / "bench_executor.py"
)
bench = importlib.util.module_from_spec(_spec)  # type: ignore[arg-type]
sys.modules["bench_executor"] = bench  # dataclasses look their module up there
_spec.loader.exec_module(bench)  # type: ignore[union-attr]

LOSS_BYTES = bench.LOSS_BYTES  # allocated in the step, alive when forward returns, never saved for backward


@pytest.fixture(scope="module")
def mlp(one_thread):
    x = torch.randn(256, 64, generator=torch.Generator().manual_seed(1), requires_grad=True)
    return bench.deep_mlp(6, 64), x


def test_held_after_forward_is_what_autograd_saved(mlp):
    m, x = copy.deepcopy(mlp[0]), mlp[1]
    fwd = lambda: bench.loss_of(m(x))  # noqa: E731
    mem = bench.step_memory(fwd, [*m.parameters(), x])
    saved = bench.saved_bytes(m, fwd, x)
    assert saved > 6 * 256 * 64 * 4  # one activation per layer at least
    assert mem.held == saved + LOSS_BYTES
    grads = sum(p.numel() * 4 for p in m.parameters()) + x.numel() * 4
    assert mem.end == grads
    assert mem.held < mem.peak


@pytest.mark.parametrize("budget", ["100%", "85%"])
def test_peak_of_an_xsched_plan_is_the_simulated_peak(mlp, budget):
    base, x = mlp
    # in-place reuse off: with it, a reused buffer counts twice in the simulator and once in the allocator
    w = wrap(
        copy.deepcopy(base),
        (x,),
        {"cpu": budget},
        method="eager" if budget == "100%" else "auto",
        inplace=False,
        profile="model",
        time_limit=3,
    )
    peak, predicted, recomputes = bench.xsched_figures(w)
    assert (recomputes > 0) == (budget != "100%")
    fwd = lambda: bench.loss_of(w(x))  # noqa: E731
    fwd().backward()
    mem = bench.step_memory(fwd, [*w.parameters(), x])
    # the loss and its gradient are the only allocations outside the plan's values
    assert 0 <= mem.peak - predicted <= 2 * LOSS_BYTES
    assert predicted < peak


def test_frees_of_older_blocks_are_not_counted(mlp):
    m, x = copy.deepcopy(mlp[0]), mlp[1]
    fwd = lambda: bench.loss_of(m(x))  # noqa: E731
    plain = bench.step_memory(fwd, [*m.parameters(), x])
    kept: list[torch.Tensor] = []
    bench.step_memory(lambda: (kept.append(torch.ones(1 << 20)), fwd())[1], [])  # profiled: its size is known

    def dropping() -> torch.Tensor:
        kept.clear()  # frees 4 MiB allocated before this step
        return fwd()

    assert bench.step_memory(dropping, [*m.parameters(), x]) == plain


def test_sees_torch_compile_allocations_per_budget(mlp):
    base, x = mlp
    held = {}
    for frac in (1.0, 0.0):
        m = copy.deepcopy(base)
        fwd, _ = bench.compiled_under(m, x, frac)
        with torch.compiler.set_stance("fail_on_recompile"):
            mem = bench.step_memory(fwd, [*m.parameters(), x])
            saved = bench.saved_bytes(m, fwd, x)
        assert mem.held == saved + LOSS_BYTES
        assert mem.peak > mem.held
        held[frac] = mem.held
    # each budget runs its own compiled graph: at 0 forward keeps nothing it can recompute
    assert held[0.0] < held[1.0] / 4
