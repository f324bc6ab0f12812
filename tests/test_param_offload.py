"""Parameters, gradients and AdamW state on a store device (issue 25): `cpu:0` computes, `cpu:1` holds the
parameters and runs no op; `xsched train --param-home cpu:1` trains GPT-2 and an MLP like eager PyTorch, with
AdamW on the store overlapped with the backward (HostAdamW), and resumes from its checkpoints exactly.

Budgets, the lowest the `park` heuristic plans today: GPT-2 (small, 2 layers of width 128, 2 heads, 16 tokens: 1.67
MiB of parameters) at 0.95 MiB, 57% of its parameters (weights fetched before their readers, gradients sent home as
they are made); the MLP at 1.06x its 1.51 MiB of parameters (there the plan holds every gradient to the backward's
end). GPT-2 is wide and short so that its weights outweigh its activations: the plan takes the same path as at 8
layers of width 64 (1.4 MiB, below 1.6 MiB of parameters), for a quarter of the search."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from torch import nn
from torch.testing import assert_close
from train_support import assert_same_weights, eager_run, eager_train, teacher_mlp

from xsched import zoo
from xsched.capture.torch import capture
from xsched.cli import main
from xsched.contracts.plan import Compute, Copy, Plan
from xsched.errors import XschedError
from xsched.execute.wrap import wrap
from xsched.train import TrainConfig, train
from xsched.train.checkpoint import read_checkpoint
from xsched.train.host_adamw import HostAdamW
from xsched.zoo import tasks

pytestmark = pytest.mark.usefixtures("one_thread")

MLP = teacher_mlp(6, 256)
# the fused CPU AdamW step rounds differently from torch's default for-loop AdamW (about 1e-7 per step)
FUSED = {"rtol": 1e-4, "atol": 1e-5}


@pytest.fixture
def mlp(tmp_path):
    path = tmp_path / "mlp.py"
    path.write_text(MLP)
    return path


def offloaded(model: str, cpu0: str, tmp_path, **kw) -> TrainConfig:
    return TrainConfig(
        model,
        {"cpu:0": cpu0, "cpu:1": "1GiB"},
        method="park",
        profile="model",
        cache_dir=str(tmp_path / "cache"),
        param_home="cpu:1",
        stores=("cpu:1",),
        **kw,
    )


def assert_store_plan(result, budget: int) -> None:
    """Every param and buffer lives on cpu:1, no op runs there, and cpu:0's predicted peak is within `budget`."""
    plan = Plan.load(result.plan_path)
    params = [v for v, d in plan.homes.items() if v.startswith(("param:", "buffer:"))]
    assert params and all(plan.homes[v] == "cpu:1" for v in params)
    assert {s.device for s in plan.steps if isinstance(s, Compute)} == {"cpu:0"}
    assert plan.predicted.peak_bytes["cpu:0"] <= budget == plan.budgets["cpu:0"]


def test_mlp_trains_like_eager_with_accumulation(mlp, tmp_path) -> None:
    """Two micro-batches of 8 per step (gradients accumulated on the store) equal eager AdamW on batches of 16."""
    config = offloaded(f"{mlp}:factory", "1.6MiB", tmp_path, steps=5, batch=8, grad_accum=2)
    result = train(dataclasses.replace(config, checkpoint_dir=str(tmp_path / "ck")))
    assert_store_plan(result, int(1.6 * 2**20))
    assert result.optimizer is not None and result.optimizer.optimizer_s > 0  # the overlapped host optimizer ran
    want, model = eager_run(mlp, batch=16, world=1, steps=5)
    assert_close(result.losses, want, rtol=1e-5, atol=1e-6)
    assert_same_weights(read_checkpoint(tmp_path / "ck", 5)["model"], model, **FUSED)


def test_gpt2_below_its_parameters_trains_like_eager(tmp_path) -> None:
    scale = "small:n_layer=2,n_embd=128,n_head=2,seq=16"
    ck = str(tmp_path / "ck")
    result = train(offloaded("zoo:gpt2", "0.95MiB", tmp_path, steps=5, scale=scale, checkpoint_dir=ck))
    assert_store_plan(result, int(0.95 * 2**20))
    z = zoo.build("gpt2", scale=scale)
    params = sum(p.numel() * p.element_size() for p in z.model.parameters())
    assert params > 1.5 * 0.95 * 2**20  # half as much again as cpu:0's budget
    assert result.optimizer.hidden_s >= 0  # the overlapped host optimizer ran
    want = eager_train(z.model, lambda s: tasks.task_batch("gpt2", scale, 4, s), tasks.task_loss("gpt2"), 5)
    assert_close(result.losses, want["loss"], rtol=1e-5, atol=1e-6)
    assert_close([r.grad_norm for r in result.records], want["grad_norm"], rtol=1e-5, atol=1e-6)
    assert_same_weights(read_checkpoint(tmp_path / "ck", 5)["model"], want["model"], **FUSED)


def test_resume_equals_the_uninterrupted_run_and_the_state_is_torch_adamws(mlp, tmp_path, capfd) -> None:
    """Through the CLI: 5 steps at once, and 3 then 2 resumed, give the same losses, weights and AdamW state bit for
    bit. The checkpoint's optimizer state is torch AdamW's: a run without --param-home resumes it too."""
    args = [f"{mlp}:factory", "--budget", "cpu:0=1.6MiB", "--budget", "cpu:1=1GiB", "--param-home", "cpu:1"]
    args += ["--store", "cpu:1", "--method", "park", "--profile", "model", "--cache-dir", str(tmp_path / "cache")]
    assert main(["train", *args, "--steps", "5", "--checkpoint-dir", str(tmp_path / "a"), "--json"]) == 0
    events = [json.loads(line) for line in capfd.readouterr().out.splitlines()]
    assert events[0]["param_home"] == "cpu:1" and events[0]["optimizer_overlap"] is True
    assert events[-1]["optimizer_s"] > 0
    whole = [e["loss"] for e in events if e["event"] == "step"]
    config = offloaded(f"{mlp}:factory", "1.6MiB", tmp_path, checkpoint_dir=str(tmp_path / "b"), checkpoint_every=3)
    first = train(dataclasses.replace(config, steps=3))
    second = train(dataclasses.replace(config, steps=5, resume=True))
    assert first.losses + second.losses == whole
    a, b = read_checkpoint(tmp_path / "a", 5), read_checkpoint(tmp_path / "b", 5)
    for name, t in a["model"].items():
        assert torch.equal(t, b["model"][name]), name
    for i, st in a["optimizer"]["state"].items():
        for key, t in st.items():
            assert torch.equal(t, b["optimizer"]["state"][i][key]), (i, key)
    assert a["optimizer"]["param_groups"] == b["optimizer"]["param_groups"]
    # the same checkpoint (step 3) resumed by the plain optimizer on one device
    plain = TrainConfig(
        f"{mlp}:factory",
        {"cpu": "100%"},
        steps=5,
        method="eager",
        profile="model",
        cache_dir=str(tmp_path / "cache"),
        checkpoint_dir=str(tmp_path / "c"),
    )
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "step-00000003.pt").write_bytes((tmp_path / "b" / "step-00000003.pt").read_bytes())
    again = train(dataclasses.replace(plain, resume=True))
    assert_close(again.losses, whole[3:], rtol=1e-5, atol=1e-6)
    for name, t in read_checkpoint(tmp_path / "c", 5)["model"].items():
        assert_close(t, a["model"][name], **FUSED, msg=lambda m, n=name: f"{n}: {m}")


class Recorder:
    """A listener that records what the run tells it, and keeps the gradients."""

    takes_grads = True

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []
        self.grads: dict[str, torch.Tensor] = {}

    def wait(self, name: str) -> None:
        self.calls.append(("wait", name))

    def released(self, name, grad, events) -> None:
        self.calls.append(("released", name))
        if grad is not None:
            self.grads[name] = grad.clone()


def test_each_parameter_is_waited_for_before_its_read_and_released_after_its_last_use() -> None:
    """Run inline (plan order), a copy out of the store waits for that parameter only, right before it, and each
    parameter is released by the step that ends its use there, its gradient equal to eager PyTorch's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 4))
    x = torch.randn(8, 32)
    graph = capture(model, (x,))
    w = wrap(model, (x,), {"cpu:0": "100%"}, store="cpu:1", method="offload", profile="model", param_home="cpu:1")
    rec = Recorder()
    w.listen(rec)
    w(x).square().sum().backward()
    plan, name = w.plan, {v: graph.value[v].name for v in graph.inputs}
    reads = [name[s.value] for s in plan.steps if isinstance(s, Copy) and s.src == "cpu:1" and s.value in name]
    assert [n for kind, n in rec.calls if kind == "wait"] == reads
    released = [n for kind, n in rec.calls if kind == "released"]
    assert sorted(released) == sorted(n for n, _ in model.named_parameters()) and tuple(released) == w.release_order
    for kind in ("weight", "bias"):  # the backward releases the last layer first
        assert released.index(f"4.{kind}") < released.index(f"2.{kind}") < released.index(f"0.{kind}")
    for n, _ in model.named_parameters():  # every wait for a parameter comes before its release
        assert rec.calls.index(("wait", n)) < rec.calls.index(("released", n))
    assert all(p.grad is None for p in model.parameters())  # the listener took them
    ref = nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 4))
    ref.load_state_dict(model.state_dict())
    ref(x).square().sum().backward()
    for n, p in ref.named_parameters():
        assert_close(rec.grads[n], p.grad, rtol=1e-5, atol=1e-6, msg=lambda m, n=n: f"{n}: {m}")
    w.listen(None)
    w(x).square().sum().backward()  # without a listener, autograd gets the gradients again
    for p, q in zip(model.parameters(), ref.parameters()):
        assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)


def test_two_calls_in_one_backward_and_a_missing_gradient_are_one_line_errors() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 4))
    x = torch.randn(4, 16)
    w = wrap(model, (x,), {"cpu:0": "100%"}, store="cpu:1", method="offload", profile="model", param_home="cpu:1")
    named = dict(model.named_parameters())
    host = HostAdamW([(n, named[n]) for n in w.release_order], dict.fromkeys(named, 0.0), lr=1e-3)
    w.listen(host)
    try:
        host.begin(True, True, 1e-3)
        with pytest.raises(XschedError, match="the gradient of .* arrived twice in one backward"):
            (w(x).sum() + w(x).sum()).backward()
        host.settle()
        host.begin(True, True, 1e-3)
        with pytest.raises(XschedError, match=r"the gradient of 2\.\w+ did not arrive in the backward"):
            host.end_backward()
    finally:
        w.listen(None)
        host.close()


def test_bad_homes_and_stores_are_one_line_errors(mlp, tmp_path) -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    x = torch.randn(3, 4)
    with pytest.raises(XschedError, match=r"param_home 'cpu:7' is not among the devices \['cpu:0', 'cpu:1'\]"):
        wrap(model, (x,), {"cpu:0": "1GiB", "cpu:1": "1GiB"}, param_home="cpu:7", profile="model")
    plain = wrap(model, (x,), {"cpu:0": "1GiB", "cpu:1": "1GiB"}, profile="model", method="eager")
    with pytest.raises(XschedError, match="the given plan homes weight on cpu:0, not on param_home cpu:1"):
        wrap(model, (x,), {"cpu:0": "1GiB", "cpu:1": "1GiB"}, plan=plain.plan, param_home="cpu:1")
    base = offloaded(f"{mlp}:factory", "1.6MiB", tmp_path)
    for change, message in [
        ({"param_home": "cuda:0"}, r"--param-home cuda:0 is not among the devices \['cpu:0', 'cpu:1'\]"),
        ({"stores": ("cpu:2",)}, "--store cpu:2 is not among the devices"),
        ({"stores": ("cpu:0", "cpu:1")}, "every device is a store"),
    ]:
        with pytest.raises(XschedError, match=message):
            train(dataclasses.replace(base, **change))


def test_clipping_steps_on_the_store_after_the_backward(mlp, tmp_path, capsys) -> None:
    """--clip-grad needs the total norm before any update: the optimizer steps on the store after the backward
    (said once), and still trains like eager PyTorch."""
    result = train(offloaded(f"{mlp}:factory", "1.6MiB", tmp_path, steps=3, clip_grad=0.05))
    assert "not overlapped: --clip-grad needs every gradient's norm" in capsys.readouterr().err
    assert result.optimizer is None
    ns: dict = {}
    exec(MLP, ns)
    torch.manual_seed(0)
    model, _, loss_fn, batches = ns["factory"](batch=16)
    want = eager_train(model, lambda s: ((batches(s, 0, 1)[0],), batches(s, 0, 1)[1]), loss_fn, 3, clip=0.05)
    assert_close(result.losses, want["loss"], rtol=1e-5, atol=1e-6)


class Gate:
    """A stand-in for a CUDA event: synchronize() blocks until the test opens it, and says when it was called."""

    def __init__(self, log: list[str], name: str) -> None:
        self.log, self.name, self.open = log, name, __import__("threading").Event()

    def synchronize(self) -> None:
        self.open.wait()
        self.log.append(f"synced {self.name}")


def test_host_adamw_buckets_wait_for_their_copies_and_block_only_their_own_reads() -> None:
    """Three buckets; each update waits for its gradients' copy events, and while the last bucket's copy is held a
    read of its parameter waits, reads of the others' do not. Two micro-batches add up; the step equals torch's
    AdamW on the summed gradients."""
    import threading

    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(64, 8)) for _ in range(3)]
    ref = [nn.Parameter(p.detach().clone()) for p in params]
    names = [f"p{i}" for i in range(3)]
    host = HostAdamW(list(zip(names, params)), dict.fromkeys(names, 0.01), lr=0.1, bucket_bytes=64 * 8 * 4)
    assert len(host.buckets) == 3
    grads = [[torch.randn(64, 8) for _ in range(3)] for _ in range(2)]
    log: list[str] = []
    gates = [Gate(log, n) for n in names]
    try:
        host.begin(True, False, 0.1)
        for n, g in zip(names, grads[0]):
            host.released(n, g, [])
        host.end_backward()
        host.begin(False, True, 0.1)
        for n, g, gate in zip(names, grads[1], gates):
            host.released(n, g, [gate])
        host.end_backward()
        gates[0].open.set()
        gates[1].open.set()  # p2's copy has not landed: its bucket cannot update, the others can
        blocked = threading.Thread(target=host.wait, args=("p2",))
        blocked.start()
        host.wait("p0")  # returns once p0's own update is done
        host.wait("p1")
        blocked.join(timeout=0.5)
        assert blocked.is_alive()  # still waiting for p2's bucket
        gates[2].open.set()
        blocked.join(timeout=60)
        assert not blocked.is_alive()
        norm = host.grad_norm()
        host.settle()
    finally:
        for gate in gates:
            gate.open.set()
        host.close()
    assert log == ["synced p0", "synced p1", "synced p2"]
    summed = [a + b for a, b in zip(*grads)]
    assert norm == pytest.approx(float(torch.linalg.vector_norm(torch.stack([g.norm() for g in summed]))), rel=1e-5)
    opt = torch.optim.AdamW(ref, lr=0.1, weight_decay=0.01)
    for p, g in zip(ref, summed):
        p.grad = g
    opt.step()
    for p, q in zip(params, ref):
        assert_close(p.detach(), q.detach(), **FUSED)


def test_planned_addresses_train_like_eager(mlp, tmp_path, monkeypatch) -> None:
    """`xsched train --planned-addresses` (TrainConfig.planned_addresses) with the weights, gradients and AdamW on the
    store: the step's values on cpu:0 run in its arena, and the losses and final weights are eager AdamW's."""
    import xsched.execute.executor as executor_module

    arenas = []

    class Recorded(executor_module.Arena):
        def __init__(self, *args, **kw) -> None:
            super().__init__(*args, **kw)
            arenas.append(self)

    monkeypatch.setattr(executor_module, "Arena", Recorded)
    config = offloaded(f"{mlp}:factory", "1.6MiB", tmp_path, steps=4, batch=8, planned_addresses=True)
    result = train(dataclasses.replace(config, checkpoint_dir=str(tmp_path / "ck")))
    assert_store_plan(result, int(1.6 * 2**20))
    assert arenas and all(a.planned.addresses.arena_bytes.get("cpu:0", 0) > 0 for a in arenas)
    assert any(a.planned.compute_steps for a in arenas)  # computes wrote into their slots
    want, model = eager_run(mlp, batch=8, world=1, steps=4)
    assert_close(result.losses, want, rtol=1e-5, atol=1e-6)
    assert_same_weights(read_checkpoint(tmp_path / "ck", 4)["model"], model, **FUSED)
