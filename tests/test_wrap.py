"""The drop-in module: training steps, eval/no_grad, repeated calls and new input shapes, against eager PyTorch."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.testing import assert_close

from xsched.contracts.plan import Compute, Copy
from xsched.errors import BudgetError, XschedError
from xsched.execute.wrap import XschedModule, wrap
from xsched.execute.wrap_signature import positional

pytestmark = pytest.mark.usefixtures("one_thread")


def mlp(depth: int = 6, width: int = 48) -> nn.Module:
    """Dropout and batch norm in every block: recomputation must replay masks and update stats once."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.BatchNorm1d(width), nn.ReLU(), nn.Dropout(0.3)]
    return nn.Sequential(*layers, nn.Linear(width, 10)).train()


def batch(n: int = 256, width: int = 48, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, width, generator=g), torch.randint(0, 10, (n,), generator=g)


def train(model: nn.Module, steps: int, seed: int = 5, calls: int = 1) -> list[torch.Tensor]:
    """SGD steps; `calls` forward calls per iteration, their losses summed. Returns the losses."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    torch.manual_seed(seed)
    losses = []
    for k in range(steps):
        loss = sum(nn.functional.cross_entropy(model(x), y) for x, y in (batch(seed=k * 2 + j) for j in range(calls)))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return losses


def assert_same_state(a: nn.Module, b: nn.Module) -> None:
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert_close(p, q, rtol=1e-5, atol=1e-6, msg=lambda m, n=n: f"param {n}: {m}")
    for (n, p), (_, q) in zip(a.named_buffers(), b.named_buffers()):
        assert_close(p, q, rtol=1e-5, atol=1e-6, msg=lambda m, n=n: f"buffer {n}: {m}")


@pytest.mark.parametrize(
    "budgets,method",
    [({"cpu": "100%"}, "eager"), ({"cpu": "50%"}, "auto"), ({"cpu:0": "45%", "cpu:1": "100%"}, "greedy")],
    ids=["eager", "recompute-50%", "two-devices"],
)
def test_trains_like_eager(budgets: dict, method: str) -> None:
    """Dropout + batch norm, SGD with momentum, 3 steps: losses, params and running stats equal eager's."""
    eager = mlp()
    model = copy.deepcopy(eager)
    w = wrap(model, batch()[:1], budgets, method=method, profile="model", time_limit=3)
    c = w._first
    if method == "auto":  # the 50% budget forces recomputation
        assert sum(isinstance(s, Compute) for s in c.plan.steps) > len(c.graph.ops)
    if method == "greedy":
        assert any(isinstance(s, Copy) for s in c.plan.steps)
    ref = train(eager, 3)
    got = train(w, 3)
    for a, b in zip(got, ref):
        assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert_same_state(model, eager)


def test_a_forward_output_recomputed_at_the_end_trains_like_eager() -> None:
    """Linear-BN-ReLU x4 at 55% of its eager peak: of the checkpoint candidates only eviction that also evicts the
    model's output once backward has read it (recomputed at the end) fits, where the caller does not hold the output
    (hold_outputs=False; tests/test_wrap_held.py counts what holding it costs); that plan trains like eager."""
    torch.manual_seed(0)
    eager = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(64, 64), nn.BatchNorm1d(64), nn.ReLU())])
    model = copy.deepcopy(eager)
    x = torch.randn(512, 64)
    w = wrap(model, (x,), {"cpu": "55%"}, method="checkpoint", profile="model", hold_outputs=False)
    assert w.plan.solver.stats.variant == "evict outputs"
    for m in (eager, w):
        opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
        for _ in range(3):
            opt.zero_grad()
            m(x).square().mean().backward()
            opt.step()
    assert_same_state(model, eager)


def test_a_forward_output_no_backward_op_reads_is_never_evicted() -> None:
    """The same blocks with a final Linear, whose output backward never reads: evicting it would break the
    boundary rule (it must be resident when backward starts), so the leanest budgets get a BudgetError."""
    torch.manual_seed(0)
    blocks = [m for _ in range(4) for m in (nn.Linear(64, 64), nn.BatchNorm1d(64), nn.ReLU())]
    model = nn.Sequential(*blocks, nn.Linear(64, 64))
    with pytest.raises(BudgetError):
        wrap(model, (torch.randn(512, 64),), {"cpu": "52%"}, method="checkpoint", profile="model")


def test_two_calls_in_one_iteration() -> None:
    eager = mlp()
    model = copy.deepcopy(eager)
    w = wrap(model, batch()[:1], {"cpu": "50%"}, profile="model", time_limit=3)
    ref = train(eager, 2, calls=2)
    got = train(w, 2, calls=2)
    for a, b in zip(got, ref):
        assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert_same_state(model, eager)


def test_grads_accumulate_like_autograd() -> None:
    eager = mlp(depth=2)
    model = copy.deepcopy(eager)
    w = wrap(model, batch()[:1], {"cpu": "100%"}, method="eager", profile="model")
    x, y = batch()
    for m in (eager, w):
        torch.manual_seed(9)
        for _ in range(2):  # two backward passes without zero_grad: grads add up
            nn.functional.cross_entropy(m(x), y).backward()
    for p, q in zip(model.parameters(), eager.parameters()):
        assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)


def test_eval_and_no_grad_run_inference_plans() -> None:
    eager = mlp()
    model = copy.deepcopy(eager)
    w = wrap(model, batch()[:1], {"cpu": "100%"}, method="eager", profile="model")
    x, _ = batch()
    torch.manual_seed(4)
    with torch.no_grad():  # train mode without grad: dropout draws and batch norm updates, as eager does
        got = w(x)
    torch.manual_seed(4)
    with torch.no_grad():
        want = eager(x)
    assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert_same_state(model, eager)
    assert not got.requires_grad
    w.eval()
    eager.eval()
    with torch.no_grad():
        got, want = w(x), eager(x)
    assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert {k[0] for k in w.compiled} == {"train", "train-nograd", "eval"}
    assert all(c.plan.boundary is None for k, c in w.compiled.items() if k[0] != "train")


def test_eval_mode_with_grad_differentiates_like_eager() -> None:
    """`.eval()` without `no_grad` (fine-tuning with batch norm's statistics frozen, or an evaluation that forgot
    `no_grad`): eager PyTorch still differentiates, so the call runs a training plan captured in eval mode, whose
    outputs have a gradient (they had none, and `backward()` failed) and whose buffers are left alone."""
    eager = mlp().eval()
    model = copy.deepcopy(eager)
    w = wrap(model, batch()[:1], {"cpu": "50%"}, method="checkpoint", profile="model").eval()
    x, y = batch()
    for m in (w, eager):
        nn.functional.cross_entropy(m(x), y).backward()
    assert {k[0] for k in w.compiled} == {"train", "eval-grad"}
    assert_same_state(model, eager)
    for p, q in zip(model.parameters(), eager.parameters(), strict=True):
        assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)


def test_new_input_shape_replans() -> None:
    eager = mlp(depth=2)
    model = copy.deepcopy(eager)
    w = wrap(model, batch(n=64)[:1], {"cpu": "100%"}, method="eager", profile="model")
    x, y = batch(n=32)
    torch.manual_seed(2)
    nn.functional.cross_entropy(w(x), y).backward()
    torch.manual_seed(2)
    nn.functional.cross_entropy(eager(x), y).backward()
    assert len(w.compiled) == 2
    for p, q in zip(model.parameters(), eager.parameters()):
        assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)


def test_a_smaller_last_batch_is_planned_within_the_first_calls_bytes() -> None:
    """A percentage is of the example inputs' eager peak: the epoch's last batch of 8 rows (whose own eager peak is
    mostly the weights, so 50% of it is below any plan's need) is planned within the same bytes, and trains like
    eager."""
    eager = mlp()
    model = copy.deepcopy(eager)
    w = wrap(model, batch()[:1], {"cpu": "50%"}, method="checkpoint", profile="model")
    x, y = batch(n=8)
    torch.manual_seed(2)
    nn.functional.cross_entropy(w(x), y).backward()
    torch.manual_seed(2)
    nn.functional.cross_entropy(eager(x), y).backward()
    small = next(c for key, c in w.compiled.items() if key[1][0][1] == (8, 48))
    assert small.plan.budgets["cpu"] == w.plan.budgets["cpu"]
    for p, q in zip(model.parameters(), eager.parameters(), strict=True):
        assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)


def test_a_call_under_autocast_is_captured_under_it() -> None:
    """Wrapped outside autocast, called inside `torch.autocast("cpu", bfloat16)` (as a user's mixed-precision loop
    does): that call's graph computes in bf16, as eager's does, instead of failing on the fp32 graph's sizes."""
    eager = mlp(depth=2)
    model = copy.deepcopy(eager)
    w = wrap(model, batch(n=64)[:1], {"cpu": "100%"}, method="eager", profile="model")
    x, y = batch(n=64)
    for m in (w, eager):
        torch.manual_seed(3)  # the same dropout masks
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = m(x)
        assert out.dtype == torch.bfloat16
        nn.functional.cross_entropy(out.float(), y).backward()
    assert_same_state(model, eager)
    for p, q in zip(model.parameters(), eager.parameters(), strict=True):
        assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)
    assert len(w.compiled) == 2  # fp32 and bf16
    w.eval(), eager.eval()
    with torch.no_grad():
        assert_close(w(x), eager(x), rtol=1e-5, atol=1e-6)  # outside autocast again: fp32


class Masked(nn.Module):
    """A forward with a keyword-friendly signature, as Hugging Face models have: input, an optional mask, a
    scale with a default, and a keyword-only flag."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(48, 32), nn.Linear(32, 10)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None, scale: float = 1.0, *, flip: bool = False):
        h = torch.relu(self.a(x)) * scale
        return self.b(h if mask is None else h * mask)


def test_keyword_arguments_are_placed_as_the_forward_orders_them() -> None:
    """`wrapped(x, mask=m)` and example inputs given as a dict run as `model(x, m)` does in eager (they raised
    TypeError); a keyword skipped over takes its default; a keyword-only parameter is a one-line error."""
    eager = Masked()
    model = copy.deepcopy(eager)
    x, y = batch(n=16)
    mask = (torch.arange(32) % 3 != 0).float()
    w = wrap(model, {"x": x, "mask": mask}, {"cpu": "100%"}, method="eager", profile="model")
    for kwargs in ({"mask": mask}, {"mask": mask, "scale": 2.0}, {"scale": 0.5}):
        for m in (w, eager):
            m.zero_grad()
            nn.functional.cross_entropy(m(x, **kwargs), y).backward()
        for p, q in zip(model.parameters(), eager.parameters(), strict=True):
            assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)
    assert_close(w(x=x), eager(x), rtol=1e-5, atol=1e-6)
    with pytest.raises(XschedError, match="takes 'flip' by keyword only"):
        w(x, flip=True)
    with pytest.raises(TypeError):
        w(x, bias=1.0)

    class Extra(nn.Module):
        def forward(self, x: torch.Tensor, **extra: torch.Tensor) -> torch.Tensor:
            return x * 2

    with pytest.raises(XschedError, match="takes 'gain' by keyword only"):
        positional(Extra(), (x,), {"gain": x})


def test_given_plan_rejects_other_shapes() -> None:
    model = mlp(depth=2)
    first = wrap(model, batch(n=64)[:1], {"cpu": "100%"}, method="eager", profile="model")
    plan = first.plan
    w = wrap(copy.deepcopy(model), batch(n=64)[:1], {}, plan=plan)
    w(batch(n=64)[0]).sum().backward()
    with pytest.raises(XschedError, match=r"differ from those of the given plan"):
        w(batch(n=32)[0])


def test_zoo_gpt2_output_structure_and_loss() -> None:
    """A model returning (logits, loss): the structure comes back and loss.backward() fills param.grad."""
    from xsched import zoo

    z = zoo.build("gpt2", scale="tiny")
    eager = z.model
    model = copy.deepcopy(eager)
    w = wrap(model, z.inputs, {"cpu": "100%"}, method="eager", profile="model")
    assert isinstance(w, XschedModule)
    torch.manual_seed(1)
    logits, loss = w(*z.inputs)
    loss.backward()
    torch.manual_seed(1)
    elogits, eloss = eager(*z.inputs)
    eloss.backward()
    assert_close(logits, elogits, rtol=1e-5, atol=1e-6)
    assert_close(loss, eloss, rtol=1e-5, atol=1e-6)
    for (n, p), (_, q) in zip(model.named_parameters(), eager.named_parameters()):
        assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=lambda m, n=n: f"{n}: {m}")


def test_backward_twice_is_a_clear_error() -> None:
    model = mlp(depth=1)
    w = wrap(model, batch()[:1], {"cpu": "100%"}, method="eager", profile="model")
    out = w(batch()[0]).sum()
    out.backward(retain_graph=True)
    with pytest.raises(XschedError, match="second time"):
        out.backward()


def test_bad_budgets_are_clear_errors() -> None:
    from xsched.errors import BudgetError

    model = mlp(depth=1)
    with pytest.raises(XschedError, match="needs devices"):
        wrap(model, batch()[:1], {})
    with pytest.raises(BudgetError, match="no plan within the budgets: proven infeasible") as e:
        wrap(model, batch()[:1], {"cpu": 1024}, profile="model")
    assert "budget 1.00 KiB on cpu is below the lower bound" in str(e.value)
    assert e.value.device == "cpu" and str(e.value).count("smallest budget known to work") == 1  # one message


def test_grads_reach_param_grad_without_copies(monkeypatch: pytest.MonkeyPatch) -> None:
    """The grads the backward plan computes become param.grad as they are (autograd steals them, views of the
    plan's tensors included): no copy per parameter per step."""
    import importlib

    wrap_module = importlib.import_module("xsched.execute.wrap")
    model = mlp(depth=2)
    w = wrap(model, batch()[:1], {"cpu": "100%"}, method="eager", profile="model")
    handed: list[int] = []
    backward = wrap_module._Run.backward

    def spy(self, grads):
        out = backward(self, grads)
        handed.extend(g.data_ptr() for g in out if g is not None)
        return out

    monkeypatch.setattr(wrap_module._Run, "backward", spy)
    w(batch()[0]).sum().backward()
    assert handed == [p.grad.data_ptr() for p in model.parameters()]


def test_measured_profile_is_cached_and_reused(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """wrap measures the graph's costs once (stored as `xsched profile` would, under profile_dir) and reuses them."""
    import xsched.execute.back_to_back as back_to_back
    import xsched.pipeline as wrap_plan
    import xsched.profiling.store as store

    model = mlp(depth=1, width=8)
    w = wrap(model, batch(n=16, width=8)[:1], {"cpu": "100%"}, method="eager", profile_dir=tmp_path)
    stored = list(tmp_path.glob("*.json"))
    assert len(stored) == 1 and stored[0].name == store.default_profile_path(w.graph, ["cpu"]).name
    assert store.load_profile(stored[0]).graph == w.graph.fingerprint
    stored_profile = store.load_profile(stored[0])
    assert stored_profile.profiling is not None and not stored_profile.modelled  # measured
    assert stored_profile.back_to_back["cpu"].step_s > 0  # and calibrated back to back

    def no_measuring(*a, **k):
        raise AssertionError("the stored profile must be reused")

    monkeypatch.setattr(wrap_plan, "profile_graph", no_measuring)
    monkeypatch.setattr(back_to_back, "profile_graph", no_measuring)  # wrap measures through profile_calibrated
    again = wrap(copy.deepcopy(model), batch(n=16, width=8)[:1], {"cpu": "100%"}, method="eager", profile_dir=tmp_path)
    assert again.plan.steps == w.plan.steps
    assert "plan by eager" in again.report() and "cpu: peak" in again.report()
    with pytest.raises(XschedError, match="profile must be a Profile or one of"):
        wrap(copy.deepcopy(model), batch(n=16, width=8)[:1], {"cpu": "100%"}, profile="guess")


@pytest.mark.parametrize(
    "budgets,store,method,profile",
    [
        ({"cpu:0": "45%"}, {"store": "cpu:1"}, "offload", "measure"),
        ({"cpu:1": "64GiB", "cpu:0": "45%"}, {"stores": ("cpu:1",)}, "park", "model"),
    ],
    ids=["measured-store-without-budget", "modelled-store-named-first"],
)
def test_a_store_parks_values_and_trains_like_eager(
    tmp_path, monkeypatch, budgets: dict, store: dict, method: str, profile: str
) -> None:
    """cpu:0 computes within 45% of the eager peak, cpu:1 is a store (profiled for its copies only: no op is
    measured there): the plan parks values on cpu:1 and fetches them back, and 3 SGD steps through dropout and
    batch norm give the eager losses, params, grads and running stats. Graph inputs stay on cpu:0 even when the
    store is named first."""
    import xsched.execute.back_to_back as back_to_back
    from xsched.devices import Policy
    from xsched.profiling.measure import profile_graph

    fast = {"policy": Policy(warmup=1, min_reps=1, max_reps=2, max_time_s=0.01, min_sample_s=1e-5), "rounds": 1}
    measured: list[tuple] = []

    def quick(graph, devices, **kw):
        measured.append((list(devices), kw.get("stores")))
        return profile_graph(graph, devices, **kw, **fast, copy_sizes=(4096, 1 << 20), per_value=2)

    monkeypatch.setattr(back_to_back, "profile_graph", quick)  # wrap measures through profile_calibrated
    eager = mlp()
    model = copy.deepcopy(eager)
    w = wrap(model, batch()[:1], budgets, method=method, profile=profile, profile_dir=tmp_path, **store)
    assert measured == ([(["cpu:0"], ["cpu:1"])] if profile == "measure" else [])
    plan = w.plan
    assert {s.device for s in plan.steps if isinstance(s, Compute)} == {"cpu:0"}
    assert set(plan.homes.values()) == {"cpu:0"}
    parked = {s.value for s in plan.steps if isinstance(s, Copy) and s.dst == "cpu:1"}
    fetched = {s.value for s in plan.steps if isinstance(s, Copy) and s.src == "cpu:1"}
    assert parked and fetched and fetched <= parked
    assert plan.predicted.peak_bytes["cpu:0"] <= plan.budgets["cpu:0"]
    ref = train(eager, 3)
    got = train(w, 3)
    for a, b in zip(got, ref):
        assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert_same_state(model, eager)
    for (n, p), (_, q) in zip(model.named_parameters(), eager.named_parameters()):
        assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=lambda m, n=n: f"grad {n}: {m}")


def test_a_store_alone_is_a_clear_error() -> None:
    with pytest.raises(XschedError, match=r"no device left to compute on: devices \['cpu:1'\] are all stores") as e:
        wrap(mlp(depth=1), batch()[:1], {"cpu:1": "1GiB"}, store="cpu:1", profile="model")
    assert "\n" not in str(e.value) and e.value.device == "cpu:1"
    with pytest.raises(XschedError, match="stores must be a sequence of device names"):
        wrap(mlp(depth=1), batch()[:1], {"cpu:0": "1GiB"}, stores="cpu:1", profile="model")
