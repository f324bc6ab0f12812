"""HostAdamW's work order and its pieces: the direct fused step equals torch's fused AdamW bit for bit, the norm
over a 2-D view equals torch's, the worker takes every landed gradient before any update and updates the buckets in
the order the next forward reads them, the training loop's norm does not wait for the updates, and a wrapped
model's read order puts its first layer first."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

from xsched.train import host_adamw
from xsched.train.host_adamw import HostAdamW
from xsched.train.host_buckets import NORM_ROW, make_bucket, sq_norm
from xsched.train.host_tasks import TAKE, UPDATE, TaskQueue, read_ranks


class Spans:
    """A StepClock stand-in that keeps the optimizer's span labels in the order they end."""

    def __init__(self) -> None:
        self.labels: list[str] = []

    def span(self, lane: str, label: str, t0: float, t1: float) -> None:
        self.labels.append(label)

    def waited(self, what: str, t0: float, t1: float) -> None:
        pass


class Gate:
    """A copy event that completes when opened (it cannot be asked: the worker counts it as under way)."""

    def __init__(self) -> None:
        self.open = threading.Event()

    def synchronize(self) -> None:
        self.open.wait()


class Flag(Gate):
    """A copy event that can be asked whether it has completed."""

    def query(self) -> bool:
        return self.open.is_set()


class Done:
    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


def _params(k: int, seed: int = 0) -> list[tuple[str, nn.Parameter]]:
    torch.manual_seed(seed)
    return [(f"p{i}", nn.Parameter(torch.randn(16, 8))) for i in range(k)]


def test_the_direct_fused_step_equals_torch_fused_adamw_bit_for_bit_and_exports_its_state() -> None:
    """Two weight decays in one bucket and buckets of several parameters; three steps at changing rates."""
    named = _params(6)
    ref = [nn.Parameter(p.detach().clone()) for _, p in named]
    decay = {n: (0.1 if i % 2 else 0.0) for i, (n, _) in enumerate(named)}
    groups = [
        {"params": [q for q, (n, _) in zip(ref, named) if decay[n] == wd], "weight_decay": wd} for wd in (0.0, 0.1)
    ]
    opt = torch.optim.AdamW(groups, lr=1e-2, fused=True)
    host = HostAdamW(named, decay, lr=1e-2, bucket_bytes=3 * 16 * 8 * 4)
    assert len(host.buckets) == 2
    try:
        for step, lr in enumerate((1e-2, 5e-3, 2e-2)):
            grads = [torch.randn(16, 8) for _ in named]
            host.begin(True, True, lr)
            for (n, _), g in reversed(list(zip(named, grads))):
                host.released(n, g.clone(), [])
            host.end_backward()
            host.settle()
            for q, g in zip(ref, grads):
                q.grad = g
            for group in opt.param_groups:
                group["lr"] = lr
            opt.step()
            for (n, p), q in zip(named, ref):
                assert torch.equal(p.detach(), q.detach()), (step, n)
        facade = torch.optim.AdamW([p for _, p in named], lr=1e-2)
        host.export_state(facade)
        for (_, p), q in zip(named, ref):
            mine, theirs = facade.state[p], opt.state[q]
            assert float(mine["step"]) == float(theirs["step"]) == 3.0
            assert torch.equal(mine["exp_avg"], theirs["exp_avg"]) and torch.equal(
                mine["exp_avg_sq"], theirs["exp_avg_sq"]
            )
    finally:
        host.close()


def test_a_lone_contiguous_parameter_keeps_its_memory_and_the_others_are_packed_into_one_buffer() -> None:
    """A bucket's segment (one weight decay) is one flat buffer its parameters are views of: a lone contiguous
    parameter is that buffer itself, not a copy (a large model's big weights are not copied again); a lone
    non-contiguous one and several together are copied. The values stay as they were."""
    torch.manual_seed(0)
    lone = nn.Parameter(torch.randn(16, 8))
    turned = nn.Parameter(torch.randn(8, 16).t())  # not contiguous
    a, b = nn.Parameter(torch.randn(4)), nn.Parameter(torch.randn(3))
    named = [("lone", lone), ("turned", turned), ("a", a), ("b", b)]
    values = [p.detach().clone() for _, p in named]
    where = lone.data_ptr()
    bucket = make_bucket(0, named, {"lone": 0.1, "turned": 0.2, "a": 0.0, "b": 0.0}, 1e-3, separate=False)
    assert [len(seg.params) for seg in bucket.segments] == [1, 1, 2]
    assert lone.data_ptr() == where == bucket.slots["lone"][0].compute.data_ptr()
    assert turned.is_contiguous() and turned.data_ptr() == bucket.slots["turned"][0].compute.data_ptr()
    assert b.data_ptr() == a.data_ptr() + 4 * a.element_size() == bucket.slots["a"][0].compute.data_ptr() + 16
    for (n, p), v in zip(named, values):
        assert torch.equal(p.detach(), v), n


@pytest.mark.parametrize("numel", [1000, 2 * NORM_ROW, 3 * NORM_ROW + 17])
def test_the_norm_over_rows_equals_torch_s(numel: int) -> None:
    t = torch.randn(numel)
    assert sq_norm(t) == pytest.approx(float(t.double().square().sum()), rel=1e-5)


def test_the_queue_takes_landed_gradients_then_updates_by_read_rank_and_keeps_each_bucket_in_order() -> None:
    q = TaskQueue(rank=[2, 0, 1])
    ran: list[str] = []
    gate = Gate()
    for b, events in ((0, [gate]), (1, [Done()]), (2, [])):
        q.push(b, TAKE, lambda b=b: ran.append(f"take {b}"), events)
        q.push(b, UPDATE, lambda b=b: ran.append(f"update {b}"))
    q.push(1, TAKE, lambda: ran.append("next take 1"))  # the next step's gradient: after bucket 1's update
    while q:
        q.pop().run()
    assert ran == ["take 1", "take 2", "update 1", "next take 1", "update 2", "take 0", "update 0"]


def test_read_ranks_follow_the_read_order_and_default_to_the_reverse_release() -> None:
    buckets = [["a", "b"], ["c"], ["d"]]
    assert read_ranks(buckets, None) == [2, 1, 0]
    assert read_ranks(buckets, ["d", "b", "c", "a"]) == [1, 2, 0]
    assert read_ranks(buckets, ["c"])[1] == 0


def test_the_norm_is_ready_before_the_updates_and_the_updates_go_first_layers_first(monkeypatch) -> None:
    """The updates are held: grad_norm() returns while none has run; released, they run in the read order."""
    named = _params(4)
    grads = [torch.randn(16, 8) for _ in named]
    hold = threading.Event()
    real = host_adamw.adamw_step

    def held(segments, lr):
        hold.wait()
        real(segments, lr)

    monkeypatch.setattr(host_adamw, "adamw_step", held)
    spans = Spans()
    host = HostAdamW(named, dict.fromkeys(dict(named), 0.0), lr=1e-2, bucket_bytes=16 * 8 * 4, clock=spans)
    try:
        gate = Flag()  # the copies land once every gradient is queued: the order does not race the worker
        host.begin(True, True, 1e-2)
        for (n, _), g in zip(named, grads):  # released p0 first: as a backward would, p0 is read last
            host.released(n, g, [gate])
        host.end_backward()
        gate.open.set()
        got: list[float] = []
        t = threading.Thread(target=lambda: got.append(host.grad_norm()))
        t.start()
        t.join(timeout=30)
        assert got, f"grad_norm waited for the held updates {spans.labels}"
        assert got[0] == pytest.approx(float(torch.stack([g.norm() for g in grads]).norm()), rel=1e-5)
        hold.set()
        host.settle()
    finally:
        hold.set()
        gate.open.set()
        host.close()
    assert spans.labels == [*(f"grads {k}" for k in range(4)), *(f"bucket {k}" for k in (3, 2, 1, 0))]


def test_a_wrapped_model_reads_its_first_layer_first() -> None:
    from xsched.execute.wrap import wrap

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 4))
    x = torch.randn(4, 16)
    w = wrap(model, (x,), {"cpu:0": "100%"}, store="cpu:1", method="offload", profile="model", param_home="cpu:1")
    assert sorted(w.read_order) == sorted(w.release_order) == sorted(n for n, _ in model.named_parameters())
    assert w.read_order.index("0.weight") < w.read_order.index("2.weight") < w.read_order.index("4.weight")
    assert w.release_order.index("4.weight") < w.release_order.index("0.weight")


class CudaLike(torch.Tensor):
    """A CPU gradient that says it is on a GPU: HostAdamW.copying takes its norm as it does a GPU's."""

    @property
    def is_cuda(self) -> bool:  # type: ignore[override]
        return True


@pytest.mark.parametrize(("micro", "gpu"), [(1, False), (2, False), (1, True)])
def test_norms_taken_as_the_gradients_are_copied_equal_eager_and_spare_the_worker(
    monkeypatch, micro: int, gpu: bool
) -> None:
    """cpu:0 computes, cpu:1 holds the parameters: with one micro-batch the norms are taken on the copy's lane (the
    worker takes none); with two, the worker takes the norm of the sum. Either way grad_norm() equals eager's.
    `gpu`: the gradients say they are on a GPU, so `copying` takes the GPU's branch (the norm into a pinned scalar,
    one launch and one copy, squared by the worker): the host takes no norm at all."""
    from xsched.execute.wrap import wrap
    from xsched.train import host_adamw as module

    calls: list[str] = []
    real = module.sq_norm
    monkeypatch.setattr(module, "sq_norm", lambda t: calls.append(threading.current_thread().name) or real(t))
    monkeypatch.setattr(module, "pinned_empty", lambda shape, dtype: torch.empty(shape, dtype=dtype))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 4))
    ref = nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 4))
    ref.load_state_dict(model.state_dict())
    xs = [torch.randn(8, 32) for _ in range(micro)]
    w = wrap(model, (xs[0],), {"cpu:0": "100%"}, store="cpu:1", method="offload", profile="model", param_home="cpu:1")
    named = dict(model.named_parameters())
    host = HostAdamW([(n, named[n]) for n in w.release_order], dict.fromkeys(named, 0.0), lr=1e-2)
    if gpu:
        copying = host.copying
        host.copying = lambda name, grad: copying(name, grad.as_subclass(CudaLike))  # type: ignore[method-assign]
    w.listen(host)
    try:
        for k, x in enumerate(xs):
            host.begin(k == 0, k == micro - 1, 1e-2)
            w(x).square().sum().backward()
            host.end_backward()
        norm = host.grad_norm()
        host.settle()
    finally:
        w.listen(None)
        host.close()
    for x in xs:
        ref(x).square().sum().backward()
    want = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), float("inf")))
    assert norm == pytest.approx(want, rel=1e-5)
    on_worker = calls.count("xsched-host-adamw")
    assert (on_worker == 0) if micro == 1 else (on_worker == len(host.buckets) and len(calls) == on_worker)
    assert (not calls and len(host._norm_out) == len(named)) if gpu else not host._norm_out
