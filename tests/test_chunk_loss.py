"""chunk_cross_entropy: the zoo GPT-2's loss split into row blocks runs as eager PyTorch (loss, logits, every
gradient), lowers the memory lower bound, and is planned below the original graph's proven bound; patterns it does
not handle are one-line errors, graphs without a loss come back unchanged; `xsched capture --chunk-loss`,
`wrap(chunk_loss=)` and `xsched train --chunk-loss` train as eager does."""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
from pathlib import Path

import pytest
import torch
from oracle import peaks
from torch import nn
from torch.testing import assert_close
from train_support import eager_train

from xsched import zoo
from xsched.capture.chunk_loss import chunk_cross_entropy, chunked_as_asked
from xsched.capture.torch import bind_inputs, capture, unpack_outputs
from xsched.contracts.plan import Compute
from xsched.errors import BudgetError, GraphError, XschedError
from xsched.execute.reference import run_plan
from xsched.execute.wrap import wrap
from xsched.pipeline import plan_profile, solve_plan
from xsched.solve import eager_peak
from xsched.solve.bounds.memory import check_budgets, lower_bounds
from xsched.train.optim import autocast

pytestmark = pytest.mark.usefixtures("one_thread")


def gpt2(scale: str = "tiny", batch: int | None = None) -> zoo.ZooModel:
    return zoo.build("gpt2", batch=batch, scale=scale)


def eager(
    model: nn.Module, inputs: tuple, every: bool, precision: str = "fp32"
) -> tuple[tuple[torch.Tensor, ...], dict[str, torch.Tensor]]:
    """(logits, loss) and the gradients of eager PyTorch: loss.backward(), or with "all" ones into both outputs
    (what bind_inputs gives the tangents); the forward under `xsched train`'s autocast for `precision`."""
    model = copy.deepcopy(model)
    torch.manual_seed(7)
    with autocast(precision, ("cuda",)):
        logits, loss = model(*inputs)
    if every:
        torch.autograd.backward([logits, loss], [torch.ones_like(logits), torch.ones_like(loss)])
    else:
        loss.backward()
    return (logits.detach(), loss.detach()), {n: p.grad for n, p in model.named_parameters()}


def run(graph, model: nn.Module, inputs: tuple, plan=None):
    plan = plan or solve_plan(graph, {"cpu": "100%"}, method="eager", profile="model")
    torch.manual_seed(7)
    return unpack_outputs(graph, run_plan(graph, plan, bind_inputs(graph, model, inputs)))


def assert_eager(graph, z: zoo.ZooModel, every: bool, plan=None, precision: str = "fp32", scale: float = 1e-6) -> None:
    """Outputs and gradients as eager's; a gradient within `scale` of its largest entry (summed per chunk, in
    another order, so cancellations differ)."""
    got = run(graph, z.model, z.inputs, plan)
    outputs, grads = eager(z.model, z.inputs, every, precision)
    for a, b in zip(got.outputs, outputs):
        assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert set(got.grads) == set(grads)
    for n, want in grads.items():
        atol = scale * max(1.0, float(want.abs().max()))
        assert_close(got.grads[n], want, rtol=1e-5, atol=atol, msg=lambda m, n=n: f"{n}: {m}")


def bound(graph) -> int:
    return lower_bounds(graph, None, ["cpu"], {v: "cpu" for v in graph.inputs})["cpu"].bytes


@pytest.mark.parametrize("chunks", [3, 4])  # 32 rows: 11 + 11 + 10, and 4 x 8
@pytest.mark.parametrize("grad_outputs", ["all", "auto"])
def test_chunked_gpt2_is_eager(grad_outputs: str, chunks: int) -> None:
    """The chunked graph's eager plan gives eager PyTorch's logits, loss and gradients; no logits-sized tensor is
    made but the logits (and, with "all", their tangent, an input), and the loss's ops come in chunk order."""
    z = gpt2()
    g = capture(z.model, z.inputs, grad_outputs=grad_outputs)
    c = chunk_cross_entropy(g, chunks)
    assert_eager(c, z, grad_outputs == "all")
    logits = c.forward_outputs[0]["ref"]
    rows, vocab = 32, 64
    whole = {v for o in c.ops for v in o.outputs if c.value[v].shape in ((rows, vocab), (2, 16, vocab))}
    assert whole == {logits} and (rows, vocab) in {g.value[v].shape for v in g.value if v != logits}
    chunk_rows = [c.value[o.outputs[0]].shape[0] for o in c.ops if o.target == "aten._log_softmax.default"]
    assert chunk_rows == [11, 11, 10] if chunks == 3 else [8] * 4
    losses = [o for o in c.ops if o.phase == "loss"]
    assert {o.target for o in losses} >= {"aten.nll_loss_forward.default", "aten.div.Tensor"}
    assert [o.target for o in c.ops if o.phase == "bwd"].count("aten._log_softmax_backward_data.default") == chunks
    assert c.extra["chunk_loss"] == chunks and c.forward_outputs == g.forward_outputs and c.grads == g.grads


def test_one_chunk_is_eager_too() -> None:
    z = gpt2()
    g = capture(z.model, z.inputs, grad_outputs="auto")
    assert_eager(chunk_cross_entropy(g, 1), z, every=False)


@pytest.mark.parametrize("weight_grad_sum", ["float32", "per_chunk"])
def test_bf16_autocast_as_xsched_train_captures_it(weight_grad_sum: str) -> None:
    """Under `xsched train`'s bf16 autocast (the GPU's rules) the loss runs in float32 between two casts, which are
    chunked too (two per chunk for the two). By default the bf16 weight gradient is summed per chunk in bf16, one
    rounding per chunk: the tied weight's gradient is 2**-7.4 of its largest entry away (within 2**-7 of its
    scale). With weight_grad_sum="float32" it is summed over the chunks in float32 (both factors cast up per chunk,
    one cast down after the loop), rounded once as eager's single matmul rounds it: loss, logits and every gradient
    are eager's (bf16 autocast, fp32 weights) to float32's tolerance."""
    z = gpt2()
    with autocast("bf16", ("cuda",)):
        g = capture(z.model, z.inputs, grad_outputs="auto")
    c = chunk_cross_entropy(g, 4, weight_grad_sum)
    in_fp32 = weight_grad_sum == "float32"

    def casts(graph) -> int:
        return sum(o.phase != "fwd" and o.target == "aten._to_copy.default" for o in graph.ops)

    assert casts(c) == casts(g) - 2 + 2 * 4 + (2 * 4 + 1 if in_fp32 else 0)
    dw = [o for o in c.ops if o.target in ("aten.mm.default", "aten.addmm.default") and o.phase == "bwd"]
    assert [c.value[o.outputs[0]].dtype for o in dw].count("float32") == (4 if in_fp32 else 0)  # the chunks' dW
    assert_eager(c, z, every=False, precision="bf16", scale=1e-6 if in_fp32 else 2**-7)


def test_planned_below_the_original_bound() -> None:
    """With a vocabulary large for its width, the loss's backward sets the original graph's lower bound: a budget
    below it is proven infeasible there, and the chunked graph (whose bound is lower) gets a checkpoint plan within
    it that runs as eager PyTorch."""
    z = gpt2("tiny:vocab=512", batch=8)
    g = capture(z.model, z.inputs, grad_outputs="all")
    c = chunk_cross_entropy(g, 4)
    before, after = bound(g), bound(c)
    assert after < before
    budget = before - 1
    with pytest.raises(BudgetError, match="lower bound"):
        check_budgets(g, None, {"cpu": budget}, ["cpu"], {v: "cpu" for v in g.inputs})
    plan = solve_plan(c, {"cpu": budget}, method="checkpoint", profile="model")
    assert peaks(c, plan, plan_profile(c, ["cpu"], "model"))["cpu"] <= budget
    assert_eager(c, z, every=True, plan=plan)


def test_bad_chunks_are_one_line_errors() -> None:
    z = gpt2()
    g = capture(z.model, z.inputs, grad_outputs="auto")
    for bad in (0, 33, -1, 2.0, True, "4"):
        with pytest.raises(GraphError, match="chunks must be an int from 1 to 32") as e:
            chunk_cross_entropy(g, bad)
        assert "\n" not in str(e.value)
    with pytest.raises(GraphError, match="weight_grad_sum must be one of per_chunk, float32, got 'bf16'") as e:
        chunk_cross_entropy(g, 4, "bf16")
    assert "\n" not in str(e.value)


class Head(nn.Module):
    """A linear head and cross-entropy, with the options the chunking does not handle."""

    def __init__(self, bias: bool = False, reduction: str = "mean", loss: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body, self.head = nn.Linear(8, 8), nn.Linear(8, 16, bias=bias)
        self.reduction, self.loss = reduction, loss

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        logits = self.head(torch.relu(self.body(x)))
        if not self.loss:
            return (logits,)
        return logits, nn.functional.cross_entropy(logits, y, reduction=self.reduction)


def head_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(12, 8, generator=g), torch.randint(0, 16, (12,), generator=g)


def test_a_plain_linear_head_is_chunked_and_eager() -> None:
    """Logits straight from a bias-free Linear (no view chain), 12 rows in 5 chunks, differentiated both ways; with
    ignored targets (-100), all of one chunk's (rows 8-9): the mean is over the targets kept, as eager's."""
    x, y = head_inputs()
    for inputs in ((x, y), (x, torch.where(torch.arange(12) % 4 < 2, -100, y))):
        for every in (True, False):
            model = Head()
            g = capture(model, inputs, grad_outputs="all" if every else "auto")
            assert_eager(chunk_cross_entropy(g, 5), zoo.ZooModel("head", model, inputs), every)


@pytest.mark.parametrize(
    ("head", "says"),
    [(Head(bias=True), "expected 2 mm"), (Head(reduction="sum"), "mean reduction")],
    ids=["bias", "sum"],
)
def test_other_patterns_are_one_line_errors(head: Head, says: str) -> None:
    """A head with a bias (its gradient sums the loss's gradient whole) or a summed loss: named, not rewritten."""
    g = capture(head, head_inputs(), grad_outputs="auto")
    with pytest.raises(GraphError, match=says) as e:
        chunk_cross_entropy(g, 2)
    assert "\n" not in str(e.value) and e.value.op is not None


def test_a_graph_without_the_loss_is_returned_unchanged() -> None:
    g = capture(Head(loss=False), head_inputs())
    assert chunk_cross_entropy(g, 2) is g


def test_the_capture_command_chunks_the_loss(tmp_path, capsys) -> None:
    """`xsched capture --chunk-loss K` writes the chunked graph; a bad K, a forward-only loss and a graph without
    a cross-entropy are one-line errors."""
    from xsched.cli import main
    from xsched.contracts.graph import Graph

    out = tmp_path / "g.json"
    args = ["capture", "zoo:gpt2", "--scale", "tiny", "--grad-outputs", "auto", "-o", str(out)]
    assert main([*args, "--chunk-loss", "3"]) == 0
    z = gpt2()
    want = chunk_cross_entropy(capture(z.model, z.inputs, grad_outputs="auto"), 3)
    assert Graph.load(out).fingerprint == want.fingerprint
    capsys.readouterr()
    for extra, says in (
        (["--chunk-loss", "0"], "chunks must be an int from 1 to 32"),
        (["--inference"], "expected one nll_loss_backward"),
    ):
        assert main([*args, "--chunk-loss", "2", *extra]) == 2
        err = capsys.readouterr().err.strip()
        assert says in err and "\n" not in err
    with pytest.raises(GraphError, match="has no cross-entropy"):
        chunked_as_asked(capture(Head(loss=False), head_inputs()), 2)


def test_the_benchmark_script_tables_the_bounds(capsys) -> None:
    """scripts/bench_chunk_loss.py's bounds table (seconds at a small scale): one row per graph, the chunked
    graphs' bound below the original's."""
    path = Path(__file__).resolve().parents[1] / "scripts" / "bench_chunk_loss.py"
    spec = importlib.util.spec_from_file_location("bench_chunk_loss", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--scale", "tiny:vocab=512", "--chunks", "2,4"]) == 0
    rows = [r.split("|") for r in capsys.readouterr().out.splitlines() if r.startswith(("| original", "| 2 ", "| 4 "))]
    assert [r[1].strip() for r in rows] == ["original", "2 chunks", "4 chunks"]
    bounds = [float(r[4].split("(")[1].rstrip("%) ")) for r in rows]  # % of the original's eager peak
    assert bounds[1] < bounds[0] and bounds[2] < bounds[0]


def test_cpu_autocast_casts_the_logits_first_and_is_refused() -> None:
    """CPU autocast's own rules cast the logits to float32 before the log_softmax and the gradient back before the
    matmul: a pattern the chunking does not take, one line naming the op."""
    with torch.autocast("cpu", dtype=torch.bfloat16):
        g = capture(Head(), head_inputs(), grad_outputs="auto")
    with pytest.raises(GraphError, match="read by \\['aten._to_copy.default'\\]; expected 2 mm") as e:
        chunk_cross_entropy(g, 2)
    assert "\n" not in str(e.value) and e.value.op is not None


def test_wrap_chunk_loss_trains_as_eager() -> None:
    """`wrap(..., chunk_loss=4)` plans the chunked graph (logits held, as wrap holds them), below the eager peak
    (recomputes): two SGD steps' logits, loss, gradients and weights are eager's. A model without a
    cross-entropy is a one-line error."""
    z = gpt2()
    model, ref = copy.deepcopy(z.model), copy.deepcopy(z.model)
    w = wrap(model, z.inputs, {"cpu": "85%"}, method="checkpoint", profile="model", chunk_loss=4)
    assert w.graph.extra["chunk_loss"] == 4 and w.graph.held_outputs
    assert sum(isinstance(s, Compute) for s in w.plan.steps) > len(w.graph.ops)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (w, ref)]
    for _ in range(2):
        outs = []
        for m, opt in zip((w, ref), opts):
            opt.zero_grad()
            torch.manual_seed(7)
            logits, loss = m(*z.inputs)
            loss.backward()
            outs.append((logits.detach(), loss.detach()))
        for a, b in zip(*outs):
            assert_close(a, b, rtol=1e-5, atol=1e-6)
        for (n, p), q in zip(model.named_parameters(), ref.parameters()):
            assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=lambda m, n=n: f"{n}: {m}")
        for opt in opts:
            opt.step()
    with pytest.raises(GraphError, match="has no cross-entropy") as e:
        wrap(Head(loss=False), head_inputs(), {"cpu": "100%"}, method="eager", profile="model", chunk_loss=2)
    assert "\n" not in str(e.value)


def test_train_chunk_loss_trains_as_eager(tmp_path) -> None:
    """`xsched train --chunk-loss 4` (TrainConfig.chunk_loss) on GPT-2 tiny below its eager peak: the losses and
    gradient norms of three AdamW steps are plain PyTorch's."""
    from xsched.train import TrainConfig, train
    from xsched.zoo import tasks

    config = TrainConfig(
        "zoo:gpt2",
        {"cpu": "85%"},
        steps=3,
        scale="tiny",
        method="checkpoint",
        profile="model",
        cache_dir=str(tmp_path),
        chunk_loss=4,
    )
    result = train(config)
    z = gpt2()
    want = eager_train(z.model, lambda s: tasks.task_batch("gpt2", "tiny", 2, s), tasks.task_loss("gpt2"), 3)
    assert_close(result.losses, want["loss"], rtol=1e-5, atol=1e-6)
    assert_close([r.grad_norm for r in result.records], want["grad_norm"], rtol=1e-5, atol=1e-6)
    with pytest.raises(XschedError, match="--chunk-loss must be at least 1, got 0"):
        dataclasses.replace(config, chunk_loss=0).check()


def test_the_memory_benchmark_measures_chunked_rows() -> None:
    """scripts/bench_gpu_memory.py --chunk-loss 4 (its chunked_rows, on logical CPUs): a row per budget, its plan
    within the budget in bytes of the original graph's eager peak, run by the executor to eager PyTorch's loss."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    import bench_gpu_memory as bench
    import bench_gpu_torch_rows

    a = bench.parse(["--device", "cpu", "--scale", "tiny", "--budgets", "80", "--iters", "1", "--warmup", "0"])
    a.profile_s, a.jobs, a.chunk_loss, a.lanes = 2.0, 1, 4, False
    z = gpt2(batch=8)
    g = capture(z.model, z.inputs, name="gpt2-tiny")

    def eager() -> float:
        logits, loss = z.model(*z.inputs)
        torch.autograd.backward([logits, loss], [torch.ones_like(logits), torch.ones_like(loss)])
        z.model.zero_grad(set_to_none=True)
        return float(loss)

    ckpt = eager_peak(g) * 90 // 100  # as torch checkpoint's measured peak would be given: bytes
    rows = bench.chunked_rows(g, bind_inputs(g, z.model, z.inputs), "cpu:0", "cpu:1", "100%", eager, a, 2.0, ckpt)
    assert [r["plan"] for r in rows] == [
        "xsched 80%, loss in 4 chunks, cpu:1 store",
        "xsched at checkpoint's peak, loss in 4 chunks, cpu:0 alone",
        "xsched at checkpoint's peak, loss in 4 chunks, cpu:1 store",
    ]
    for row, budget in zip(rows, [eager_peak(g) * 80 // 100, ckpt, ckpt]):
        assert "error" not in row, row
        assert row["budget"] == budget and row["predicted_peak"] <= row["budget"]
        torch.manual_seed(bench_gpu_torch_rows.SEED)  # as the benchmark seeds each step (dropout)
        assert row["loss"] == pytest.approx(eager(), rel=1e-5)


def test_a_model_returning_its_loss_alone_gets_its_logits_chunked_too() -> None:
    """A Hugging Face GPT-2 returning its own loss (the logits no output): the lm head's matmul is chunked with the
    loss, so no [tokens, vocab] tensor is made at all; loss and gradients are eager's."""
    import hf_models

    model = hf_models.build("gpt2", "sdpa")
    inputs = hf_models.batches("gpt2")(0)
    g = capture(model, inputs, grad_outputs="auto")
    c = chunk_cross_entropy(g, 3)  # 512 rows: 171 + 171 + 170
    rows, vocab = 512, 64
    whole = {(rows, vocab), (8, 64, vocab)}  # the logits' shapes (vocab 64 is also the sequence: not [., ., 64, 64])
    assert any(g.value[v].shape in whole for o in g.ops if o.phase != "bwd" for v in o.outputs)
    assert not any(c.value[v].shape in whole for v in c.value)
    got = run(c, model, inputs)
    ref = copy.deepcopy(model)
    torch.manual_seed(7)
    loss = ref(*inputs)
    loss.backward()
    assert_close(got.outputs[0], loss.detach(), rtol=1e-5, atol=1e-6)
    for n, p in ref.named_parameters():
        atol = 1e-6 * max(1.0, float(p.grad.abs().max()))
        assert_close(got.grads[n], p.grad, rtol=1e-5, atol=atol, msg=lambda m, n=n: f"{n}: {m}")
