"""Each host weight pinned once, in its final home (issue 30's setup): beside a GPU, the host optimizer's buckets
pin the memory the parameters become views of, and the wrapped module pins only what they leave. The CPU build of
torch cannot pin, so pinning is counted: every pinned allocation goes through `host_pin.pinned_empty`, which the
tests replace with a plain allocation they record, with `Tensor.is_pinned` answering from that record."""

from __future__ import annotations

import dataclasses
import importlib
import sys

import pytest
import torch
from torch import nn
from torch.testing import assert_close
from torch.utils._python_dispatch import TorchDispatchMode
from train_support import ROOT, eager_run, teacher_mlp

from xsched.errors import XschedError
from xsched.execute import host_pin, steps
from xsched.train import TrainConfig, host_adamw, host_buckets, train
from xsched.train.host_adamw import HostAdamW

pytestmark = pytest.mark.usefixtures("one_thread")
wrap = importlib.import_module("xsched.execute.wrap")  # the module (the package names its function `wrap`)


class PinLog(TorchDispatchMode):
    """The pinned allocations (kept alive, so no address is reused) and, while it is on, the bytes copied into
    pinned memory."""

    def __init__(self) -> None:
        super().__init__()
        self.buffers: list[torch.Tensor] = []
        self.copied = 0

    def storages(self) -> set[int]:
        return {t.untyped_storage().data_ptr() for t in self.buffers}

    def pinned_bytes(self) -> int:
        return sum(t.untyped_storage().nbytes() for t in self.buffers)

    def empty(self, shape: torch.Size | tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        t = torch.empty(shape, dtype=dtype)
        self.buffers.append(t)
        return t

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        if func is torch.ops.aten.copy_.default and args[0].is_pinned():
            self.copied += args[0].numel() * args[0].element_size()
        return func(*args, **(kwargs or {}))


@pytest.fixture
def pins(monkeypatch) -> PinLog:
    """Pinning counted, and every module beside "a GPU" (pins_host true on the logical CPU devices)."""
    log = PinLog()
    for module in (host_pin, host_buckets, host_adamw, steps):
        if hasattr(module, "pinned_empty"):
            monkeypatch.setattr(module, "pinned_empty", log.empty)
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda t: t.untyped_storage().data_ptr() in log.storages())
    monkeypatch.setattr(wrap, "pins_host", lambda devices: True)
    return log


def _mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 4))


def _nbytes(ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


def _wrapped(model: nn.Module, x: torch.Tensor) -> wrap.XschedModule:
    return wrap.wrap(
        model, (x,), {"cpu:0": "100%"}, store="cpu:1", method="offload", profile="model", param_home="cpu:1"
    )


def _host(w: wrap.XschedModule, model: nn.Module, pin: bool) -> HostAdamW:
    """HostAdamW in release order, weights decayed and biases not (so buckets hold lone and packed segments)."""
    named = dict(model.named_parameters())
    decay = {n: 0.01 if p.dim() >= 2 else 0.0 for n, p in named.items()}
    return HostAdamW([(n, named[n]) for n in w.release_order], decay, lr=1e-2, bucket_bytes=5000, pin=pin)


def test_each_weight_is_pinned_once_as_a_view_of_its_bucket_and_trains_like_eager(pins) -> None:
    """Beside a GPU, the buckets pin the weights' bytes once (a lone weight into its own pinned memory, the others
    into the segment's buffer), the first run pins nothing more, every parameter is a view of its segment's
    buffer, and two steps equal torch's fused AdamW."""
    torch.manual_seed(0)
    model, ref = _mlp(), _mlp()
    ref.load_state_dict(model.state_dict())
    xs = [torch.randn(8, 32) for _ in range(2)]
    w = _wrapped(model, xs[0])
    assert w.pins_host and not any(p.is_pinned() for p in model.parameters())  # nothing pinned before the buckets
    with pins:
        host = _host(w, model, pin=w.pins_host)
    weights = _nbytes(model.parameters())
    grads = sum(seg.grad.numel() * seg.grad.element_size() for b in host.buckets for seg in b.segments)
    assert pins.pinned_bytes() == weights + grads and pins.copied == weights  # each weight's bytes once
    segments = [seg for b in host.buckets for seg in b.segments]
    assert {len(seg.params) for seg in segments} >= {1, 2}  # both the lone and the packed path are taken
    for seg in segments:
        base = seg.compute.data_ptr()
        for p, (off, _) in zip(seg.params, seg.spans):
            assert p.is_pinned() and p.data_ptr() == base + off * p.element_size()
    w.listen(host)
    groups = [[p for p in ref.parameters() if p.dim() >= 2], [p for p in ref.parameters() if p.dim() < 2]]
    opt = torch.optim.AdamW(
        [{"params": groups[0], "weight_decay": 0.01}, {"params": groups[1], "weight_decay": 0.0}], lr=1e-2, fused=True
    )
    before = (pins.pinned_bytes(), pins.copied)
    try:
        for x in xs:
            host.begin(True, True, 1e-2)
            w(x).square().sum().backward()
            host.end_backward()
            host.settle()
            opt.zero_grad()
            ref(x).square().sum().backward()
            opt.step()
    finally:
        w.listen(None)
        host.close()
    assert pins.pinned_bytes() == before[0]  # the runs pinned nothing: no weight pinned twice, no staging
    assert host.direct == 2 * len(list(model.parameters()))  # gradients copied home into the pinned buffers
    for p, q in zip(model.parameters(), ref.parameters()):
        assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6)


def test_pinning_before_the_buckets_pins_the_packed_weights_twice(pins) -> None:
    """The old order, as a check of the count: the module pins every weight, then the buckets copy the packed ones
    into new pinned buffers, so the packed weights' bytes are pinned and copied twice."""
    torch.manual_seed(0)
    model = _mlp()
    w = _wrapped(model, torch.randn(8, 32))
    with pins:
        w.pin_host_memory()
    weights = _nbytes(model.parameters())
    assert pins.pinned_bytes() == pins.copied == weights
    with pins:
        host = _host(w, model, pin=True)
    try:
        packed = _nbytes(p for b in host.buckets for seg in b.segments if len(seg.params) > 1 for p in seg.params)
        assert packed > 0 and pins.copied == weights + packed
    finally:
        host.close()


def test_an_unpinned_optimizer_beside_a_module_that_pins_is_a_one_line_error(pins) -> None:
    """Pinning at the first run would part the parameters from an unpinned optimizer's buffers: said at listen."""
    model = _mlp()
    w = _wrapped(model, torch.randn(8, 32))
    host = _host(w, model, pin=False)
    try:
        with pytest.raises(XschedError, match="pin=module.pins_host") as e:
            w.listen(host)
        assert "\n" not in str(e.value)
    finally:
        host.close()


def test_xsched_train_with_the_parameters_on_the_host_pins_each_weight_once(pins, tmp_path) -> None:
    """`xsched train --param-home` beside "a GPU": the weights and their fp32 gradient buffers pinned once each
    (nothing else, through three steps), and the losses are eager AdamW's."""
    path = tmp_path / "mlp.py"
    path.write_text(teacher_mlp(3, 64))
    config = TrainConfig(
        f"{path}:factory",
        {"cpu:0": "100%", "cpu:1": "1GiB"},
        method="offload",
        profile="model",
        cache_dir=str(tmp_path / "cache"),
        param_home="cpu:1",
        stores=("cpu:1",),
        steps=3,
        batch=8,
    )
    result = train(dataclasses.replace(config))
    want, model = eager_run(path, batch=8, world=1, steps=3)
    weights = _nbytes(model.parameters())
    assert pins.pinned_bytes() == 2 * weights  # the weights once, and their fp32 gradient buffers
    assert_close(result.losses, want, rtol=1e-5, atol=1e-6)


def test_the_pinning_bench_counts_the_weights_once_now_and_the_packed_ones_twice_before() -> None:
    """scripts/bench_host_pinning.py on the tiny GPT-2: now every parameter and buffer byte is pinned and copied
    once and none is dead; before, the packed ones were pinned again and their first copies left dead."""
    sys.path.insert(0, str(ROOT / "scripts"))
    bench = importlib.import_module("bench_host_pinning")
    model = bench.empty_model("gpt2", "tiny")
    held = _nbytes([*model.parameters(), *model.buffers()])
    names = bench.release_order(model, "gpt2", "tiny", "reverse")
    before = bench.setup(model, names, before=True)
    now = bench.setup(bench.empty_model("gpt2", "tiny"), names, before=False)
    assert now["weights pinned"] == now["copied into pinned"] == held and now["dead pinned"] == 0
    assert before["dead pinned"] > 0 and before["weights pinned"] == held + before["dead pinned"]
    assert before["gradients pinned"] == now["gradients pinned"] == _nbytes(model.parameters())
