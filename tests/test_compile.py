"""Compiled segments (xsched.execute.segments) against eager PyTorch: training steps on cpu:0 and on cpu:0 + cpu:1,
the fallback of a region the compiler refuses, and the compiled plan's predicted peak against the allocator."""

from __future__ import annotations

import copy
import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.testing import assert_close

from xsched.capture.torch import bind_inputs, capture
from xsched.contracts.graph import Graph
from xsched.contracts.plan import Compute, Copy, Free, Plan
from xsched.execute.compiled_walk import compiled_peaks
from xsched.execute.executor import Executor
from xsched.execute.segments import regions_of
from xsched.execute.wrap import wrap
from xsched.pipeline import PER_OP_KEY
from xsched.solve.reference import eager_plan

pytestmark = pytest.mark.usefixtures("one_thread")

# torch.compile's own tolerance against eager on float32 (fused kernels reassociate sums): torch's inductor tests
TOL = {"rtol": 1e-4, "atol": 1e-5}


def model() -> nn.Module:
    """Pointwise chains (GELU, tanh, residual adds), layer and batch norm, and dropout: what inductor fuses, a
    buffer update (watched) and random draws that must match eager's."""
    torch.manual_seed(0)

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln, self.fc, self.bn, self.drop = (
                nn.LayerNorm(32),
                nn.Linear(32, 32),
                nn.BatchNorm1d(32),
                nn.Dropout(0.2),
            )

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.drop(torch.tanh(self.bn(nn.functional.gelu(self.fc(self.ln(x))))))

    return nn.Sequential(nn.Linear(16, 32), Block(), Block(), nn.Linear(32, 4)).train()


def data(k: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(k)
    return torch.randn(64, 16, generator=g), torch.randint(0, 4, (64,), generator=g)


def train(m: nn.Module, steps: int) -> list[torch.Tensor]:
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    torch.manual_seed(5)
    losses = []
    for k in range(steps):
        x, y = data(k)
        loss = nn.functional.cross_entropy(m(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return losses


@pytest.mark.parametrize(
    "budgets,method",
    # 110%: inductor's own buffers take a compiled eager plan a little over the per-op peak, and the eager method
    # cannot plan again below it (that region would run uncompiled)
    [({"cpu:0": "110%"}, "eager"), ({"cpu:0": "45%", "cpu:1": "100%"}, "greedy")],
    ids=["cpu0", "cpu0-cpu1"],
)
def test_compiled_plans_train_like_eager(budgets: dict, method: str) -> None:
    eager = model()
    m = copy.deepcopy(eager)
    w = wrap(m, data(0)[:1], budgets, method=method, profile="model", time_limit=10, compile=True)
    plan = w.plan
    if method == "greedy":
        assert {s.device for s in plan.steps if isinstance(s, Compute)} == {"cpu:0", "cpu:1"}
        assert any(isinstance(s, Copy) for s in plan.steps)
    got, ref = train(w, 2), train(eager, 2)
    segments = w._first.executor.segments
    assert segments.peaks and not segments.failed  # regions ran compiled, and were measured on their first run
    for a, b in zip(got, ref):
        assert_close(a, b, **TOL)
    for (n, p), (_, q) in zip(
        [*m.named_parameters(), *m.named_buffers()], [*eager.named_parameters(), *eager.named_buffers()]
    ):
        assert_close(p, q, **TOL, msg=lambda s, n=n: f"{n}: {s}")


def _mlp_graph() -> tuple[nn.Module, Graph, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8), nn.Tanh())
    x = torch.randn(4, 8)
    graph = capture(m, (x,))
    env = bind_inputs(graph, m, (x,))
    env.update({v: torch.ones(graph.value[v].shape) for v in graph.inputs if graph.value[v].kind == "tangent"})
    return m, graph, env


def test_a_region_the_compiler_refuses_runs_uncompiled_with_a_notice(capsys: pytest.CaptureFixture) -> None:
    _, graph, env = _mlp_graph()
    plan = eager_plan(graph, "cpu")
    want = Executor(graph, plan)(env).outputs
    ex = Executor(graph, plan, compile=True)

    def refuse(gm: torch.fx.GraphModule, inputs: list) -> None:
        raise RuntimeError("unsupported op\nmore detail")

    ex.segments.compile_fn = refuse
    for _ in range(2):
        got = ex(env).outputs
        assert set(got) == set(want)
        for v in want:
            assert torch.equal(got[v], want[v])
    err = capsys.readouterr().err.splitlines()
    notices = [line for line in err if "runs uncompiled" in line]
    assert notices == [
        f"xsched: region steps 0-{len(plan.steps) - 1} on cpu runs uncompiled (RuntimeError: unsupported op)"
    ]
    assert not ex.segments.peaks


def test_regions_cut_at_recomputed_random_ops_and_keep_what_the_plan_keeps() -> None:
    """Hand-checked on a 4-op chain: the region's inputs, kept outputs and drops are the plan's residency."""
    _, graph, _ = _mlp_graph()
    plan = eager_plan(graph, "cpu")
    steps = plan.steps
    parts = regions_of(graph, steps, range(len(steps)), frozenset(), frozenset())
    assert len(parts) == 1
    r = parts[0]
    made = {v for s in steps if isinstance(s, Compute) for v in graph.op[s.op].outputs}
    freed = {s.value for s in steps if isinstance(s, Free)}
    assert set(r.outputs) == made - freed
    assert set(r.drops) == freed - made
    assert set(r.inputs) == {v for s in steps if isinstance(s, Compute) for v in graph.op[s.op].inputs} - made
    # an op run uncompiled splits the run: the steps before and after it are regions of their own, or plain steps
    op = next(s.op for s in steps if isinstance(s, Compute) and graph.op[s.op].target == "aten.gelu.default")
    parts = regions_of(graph, steps, range(len(steps)), frozenset({op}), frozenset())
    at = next(i for i, s in enumerate(steps) if isinstance(s, Compute) and s.op == op)
    assert at in parts
    flat = [j for p in parts for j in ((p,) if isinstance(p, int) else p.steps)]
    assert flat == list(range(len(steps)))


def test_a_split_region_runs_as_two_cut_before_its_highest_per_op_compute_each_measured(capsys) -> None:
    """The MLP's one region split without its code (as after a measured run): cut before the compute during which
    the region's values live hold the most bytes (counted here as a set of values), a one-line notice naming it;
    the next run runs the two parts (each of >= 2 computes a region measured on its first run, else plain steps),
    which cover the region's steps in order, and equals the uncompiled run."""
    _, graph, env = _mlp_graph()
    plan = eager_plan(graph, "cpu")
    want = Executor(graph, plan)(env).outputs
    ex = Executor(graph, plan, compile=True)
    ex.segments.compile_fn = lambda gm, inputs: lambda args: torch.fx.Interpreter(gm).boxed_run(args)
    ex(env)
    ((whole, _),) = ex.segments.peaks.items()
    ex.segments.split(whole, "cpu", "a test")
    ops = [graph.op[plan.steps[i].op] for i in whole if isinstance(plan.steps[i], Compute)]
    made = {v for op in ops for v in op.outputs}
    live = {v for op in ops for v in op.inputs} - made  # resident when the region begins
    during = {}
    for i in whole:
        s = plan.steps[i]
        if isinstance(s, Compute):
            live |= set(graph.op[s.op].outputs)
            during[i] = sum(graph.value[v].nbytes for v in live)
        else:
            live.discard(s.value)
    cut = max(during, key=lambda i: (during[i], -i))
    cut = cut if cut != min(during) else sorted(during)[1]  # never before the first compute
    assert ex.segments.cuts == {cut} and not ex.segments.peaks
    assert capsys.readouterr().err == (
        f"xsched: region steps {whole[0]}-{whole[-1]} on cpu split before step {cut} (a test)\n"
    )
    got = ex(env).outputs
    for v in want:
        assert torch.equal(got[v], want[v])
    parts = regions_of(graph, plan.steps, whole, frozenset(), frozenset(), {cut})
    flat = [j for p in parts for j in ((p,) if isinstance(p, int) else p.steps)]
    assert flat == list(whole) and any(not isinstance(p, int) and p.steps[0] == cut for p in parts)
    assert set(ex.segments.peaks) == {p.steps for p in parts if not isinstance(p, int)}


WRAPPER = """
class Runner:
    def call(self, args):
        arg0_1, arg1_1 = args
        args.clear()
        buf0 = empty_strided_cpu((4, 8), (8, 1), torch.float32)
        cpp_fused_0(arg0_1, buf0)
        del arg0_1
        buf1 = buf0; del buf0  # reuse
        buf2 = empty_strided_cpu((4, 4, 2), (8, 2, 1), torch.float64)
        buf3 = reinterpret_tensor(buf2, (32, ), (1, ), 0)  # alias
        extern_kernels.mm(buf1, arg1_1, out=buf2)
        del buf2
        buf4 = empty_strided_cpu((2, 3), (1, 2), torch.int64)
        del buf1
        return (buf3, buf4, )

    def later(self):
        buf9 = empty_strided_cpu((1000, ), (1, ), torch.float32)
"""


def test_the_code_peak_follows_a_wrappers_allocations_renames_and_dels_counted_by_hand() -> None:
    """By hand: buf0 128 B; the dying 64 B input leaves (64 B); buf2, 32 float64 by its strides, 320 B; its name
    goes but its alias buf3 holds it; buf4, 6 int64 by its strides (1, 2), 368 B, the peak; then buf1 (renamed
    buf0) leaves. A held input never leaves; another method's lines are not the call's; a line that allocates
    otherwise, or a symbolic size, gives no figure."""
    from xsched.execute.compiled_code import code_peak

    x, w = torch.zeros(16), torch.zeros(100)
    assert code_peak(WRAPPER, [x, w], [True, False]) == 128 - 64 + 256 + 48
    assert code_peak(WRAPPER, [x, w], [False, False]) == 128 + 256 + 48
    unknown = WRAPPER.replace("buf4 = empty_strided_cpu((2, 3), (1, 2), torch.int64)", "buf4 = aten.foo(buf1)")
    assert code_peak(unknown, [x, w], [True, False]) is None
    symbolic = WRAPPER.replace("(4, 8), (8, 1)", "(s0, 8), (8, 1)")
    assert code_peak(symbolic, [x, w], [True, False]) is None


def _attention_like(a: torch.Tensor, w: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    p = torch.softmax(a @ w, dim=-1)
    return p * m, (p.t() @ a).tanh()


@pytest.mark.parametrize("dies", [(True, False, True), (False, False, False)], ids=["inputs-die", "inputs-held"])
def test_a_regions_compiled_code_peak_is_the_allocators_count(dies: tuple[bool, ...]) -> None:
    """Inductor's wrapper for a matmul, a softmax fused with what reads it, and a reduction: its peak read from the
    code before it runs equals the allocator's count of the call (the inputs of `dies` held by the call alone,
    dying at their last use in it)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from xsched.execute.compiled_code import code_peak
    from xsched.execute.compiled_measure import measured_peak
    from xsched.execute.segments import _inductor

    g = torch.Generator().manual_seed(0)
    inputs = [torch.randn(64, 32, generator=g), torch.randn(32, 48, generator=g), torch.rand(64, 48, generator=g)]
    gm = make_fx(_attention_like)(*inputs)
    fn = _inductor(gm, [x.clone() for x in inputs])
    args = [x.clone() for x in inputs]
    held = [a for a, d in zip(args, dies) if not d]
    want = code_peak(fn.source_code, args, dies)
    dying = [a for a, d in zip(args, dies) if d]
    outs, got = measured_peak(lambda: fn(args), torch.device("cpu"), dying)
    del held  # the inputs the call does not own lived through it
    assert want == got > 0
    for o, r in zip(outs, _attention_like(*inputs)):
        assert_close(o, r, **TOL)
    assert code_peak("def call(self, args):\n    buf0 = torch.ops.aten.foo.default(args)\n", [], []) is None


EXAMPLE_GRAPH = {  # docs/ARCHITECTURE.md's example, counted there by hand: CPU peak 300 B, GPU 550 B
    "schema": "xsched.graph/1",
    "name": "example",
    "values": [
        {"id": "x", "nbytes": 100, "kind": "input"},
        {"id": "a", "nbytes": 200},
        {"id": "b", "nbytes": 300},
        {"id": "out", "nbytes": 10},
        {"id": "y", "nbytes": 10},
    ],
    "ops": [
        {"id": "op0", "target": "f", "inputs": ["x"], "outputs": ["a"]},
        {"id": "op1", "target": "g", "inputs": ["a"], "outputs": ["b"], "workspace_bytes": 50},
        {"id": "op2", "target": "h", "inputs": ["a", "b"], "outputs": ["out"]},
        {"id": "op3", "target": "k", "inputs": ["x"], "outputs": ["y"]},
    ],
    "outputs": ["out", "y"],
}
EXAMPLE_STEPS = [
    {"do": "compute", "op": "op0", "device": "cpu"},
    {"do": "copy", "value": "a", "src": "cpu", "dst": "cuda:0"},
    {"do": "free", "value": "a", "device": "cpu"},
    {"do": "compute", "op": "op3", "device": "cpu"},
    {"do": "compute", "op": "op1", "device": "cuda:0"},
    {"do": "compute", "op": "op2", "device": "cuda:0"},
    {"do": "free", "value": "a", "device": "cuda:0"},
    {"do": "free", "value": "b", "device": "cuda:0"},
]


def test_compiled_peaks_count_a_region_as_measured() -> None:
    """By hand: the GPU's run of steps 4-7 measured at 60 B above the 200 B resident when it starts peaks at 260 B
    (the per-op count says 550 B). On the CPU, step 0 measured at 250 B peaks at 100 + 250 B, and steps 2-3 at
    5 B above the 300 B resident when they start (x and a) count 305 B."""
    graph = Graph.from_dict(EXAMPLE_GRAPH)
    plan = Plan.from_dict(
        {
            "schema": "xsched.plan/1",
            "graph": graph.fingerprint,
            "budgets": {},
            "homes": {"x": "cpu"},
            "steps": EXAMPLE_STEPS,
        }
    )
    assert compiled_peaks(graph, plan, {}) == {"cpu": 300, "cuda:0": 550}
    assert compiled_peaks(graph, plan, {(4, 5, 6, 7): 60}) == {"cpu": 300, "cuda:0": 260}
    # step 0 as a region measured at 250 B: 100 B resident + 250 B; step 3 alone would count 100 + 10
    assert compiled_peaks(graph, plan, {(0,): 250, (2, 3): 5}) == {"cpu": 350, "cuda:0": 550}


_spec = importlib.util.spec_from_file_location(
    "bench_executor", Path(__file__).resolve().parents[1] / "scripts" / "bench_executor.py"
)
bench = importlib.util.module_from_spec(_spec)  # type: ignore[arg-type]
sys.modules["bench_executor"] = bench
_spec.loader.exec_module(bench)  # type: ignore[union-attr]


def chain() -> nn.Module:
    """Linear, layer norm, GELU, tanh: no dropout or batch norm, whose uncompiled steps allocate beside the plan's
    values (the executor's own count misses those bytes too), so the allocator's count is exact here."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(16, 32),
        nn.LayerNorm(32),
        nn.GELU(),
        nn.Linear(32, 32),
        nn.Tanh(),
        nn.Linear(32, 32),
        nn.GELU(),
        nn.Linear(32, 4),
    )


def test_a_compiled_recomputing_plan_trains_like_eager_and_peaks_where_the_allocator_does() -> None:
    """At 85% of the eager peak (the plan recomputes): one step under the profiler, every CPU allocation and free
    replayed (bench_executor.step_memory), against the plan's peak with each compiled region counted as its first
    run measured it. In-place reuse off: the uncompiled steps then allocate as the plan counts. The loss and its
    gradient are the only allocations outside the plan's values. Its gradients are eager PyTorch's."""
    x = data(0)[0]
    eager = chain()
    w = wrap(
        copy.deepcopy(eager),
        (x,),
        {"cpu": "85%"},
        method="auto",
        inplace=False,
        profile="model",
        time_limit=10,
        compile=True,
    )
    fwd = lambda: bench.loss_of(w(x))  # noqa: E731
    fwd().backward()  # compiles and measures the regions
    c = w._first
    segments = c.executor.segments
    assert segments.peaks and not segments.failed
    peak = compiled_peaks(c.graph, c.plan, segments.peaks)["cpu"]
    before = sum(c.graph.value[v].nbytes for v in c.graph.inputs if c.graph.value[v].kind != "tangent")
    mem = bench.step_memory(fwd, [*w.parameters(), x])
    assert 0 <= mem.peak - (peak - before) <= 2 * bench.LOSS_BYTES
    # fused intermediates never materialise: the compiled plan's peak is below the plan's per-op count
    assert peak < c.plan.extra[PER_OP_KEY]["cpu"]  # the solver's count, kept once the regions were measured
    assert sum(isinstance(s, Compute) for s in c.plan.steps) > len(c.graph.ops)
    bench.loss_of(eager(x)).backward()
    for (n, p), q in zip(eager.named_parameters(), w.parameters()):
        assert_close(q.grad, p.grad, **TOL, msg=lambda s, n=n: f"grad of {n}: {s}")
