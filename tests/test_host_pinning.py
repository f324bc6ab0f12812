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
from train_support import ROOT, adamw, eager_run, steps_beside_adamw, teacher_mlp, weight_decays

from xsched.errors import XschedError
from xsched.execute import host_pin, steps
from xsched.train import TrainConfig, host_adamw, host_buckets, optim, train
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

    def dead(self, tensors) -> int:  # noqa: ANN001
        """The pinned bytes none of `tensors` holds."""
        held = {t.untyped_storage().data_ptr() for t in tensors}
        return sum(t.untyped_storage().nbytes() for t in self.buffers if t.untyped_storage().data_ptr() not in held)

    def whole(self) -> bool:
        """Every pinned allocation is a power of two: torch's host allocator, which rounds to one, adds nothing."""
        return all(t.untyped_storage().nbytes() & (t.untyped_storage().nbytes() - 1) == 0 for t in self.buffers)

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
    """Sizes that are not powers of two, so a buffer pinned alone would be rounded up."""
    return nn.Sequential(nn.Linear(24, 40), nn.GELU(), nn.Linear(40, 40), nn.GELU(), nn.Linear(40, 3))


def _nbytes(ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


def _wrapped(model: nn.Module, x: torch.Tensor) -> wrap.XschedModule:
    return wrap.wrap(
        model, (x,), {"cpu:0": "100%"}, store="cpu:1", method="offload", profile="model", param_home="cpu:1"
    )


def _host(w: wrap.XschedModule, model: nn.Module, pin: bool) -> HostAdamW:
    """HostAdamW in release order, weights decayed and biases not (so buckets hold lone and packed segments)."""
    named = dict(model.named_parameters())
    return HostAdamW(
        [(n, named[n]) for n in w.release_order], weight_decays(model), lr=1e-2, bucket_bytes=5000, pin=pin
    )


def test_each_weight_is_pinned_once_as_a_view_of_its_bucket_and_trains_like_eager(pins) -> None:
    """Beside a GPU, the buckets copy the weights' bytes once into pinned slabs (a lone weight alone, the others
    as the segment's buffer), the first run pins nothing more, every parameter is a view of its segment's buffer,
    no pinned memory is dead, and two steps equal torch's fused AdamW."""
    torch.manual_seed(0)
    model, ref = _mlp(), _mlp()
    ref.load_state_dict(model.state_dict())
    xs = [torch.randn(8, 24) for _ in range(2)]
    w = _wrapped(model, xs[0])
    assert w.pins_host and not any(p.is_pinned() for p in model.parameters())  # nothing pinned before the buckets
    with pins:
        host = _host(w, model, pin=w.pins_host)
    segments = [seg for b in host.buckets for seg in b.segments]
    assert pins.copied == _nbytes(model.parameters())  # each weight's bytes once
    assert pins.whole() and pins.dead([*model.parameters(), *(seg.grad for seg in segments)]) == 0
    assert {len(seg.params) for seg in segments} >= {1, 2}  # both the lone and the packed path are taken
    for seg in segments:
        base = seg.compute.data_ptr()
        for p, (off, _) in zip(seg.params, seg.spans):
            assert p.is_pinned() and p.data_ptr() == base + off * p.element_size()
    w.listen(host)
    opt = adamw(ref, lr=1e-2, fused=True)
    before = (pins.pinned_bytes(), pins.copied)
    steps_beside_adamw(w, host, ref, opt, xs)
    assert pins.pinned_bytes() == before[0]  # the runs pinned nothing: no weight pinned twice, no staging
    assert host.direct == 2 * len(list(model.parameters()))  # gradients copied home into the pinned buffers
    for p, q in zip(model.parameters(), ref.parameters()):
        assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6)


def test_pinning_before_the_buckets_pins_the_packed_weights_twice(pins) -> None:
    """The old order, as a check of the count: the module pins every weight, then the buckets copy the packed ones
    into new pinned buffers, so the packed weights' bytes are pinned and copied twice."""
    torch.manual_seed(0)
    model = _mlp()
    w = _wrapped(model, torch.randn(8, 24))
    with pins:
        w.pin_host_memory()
    weights = _nbytes(model.parameters())
    assert pins.copied == weights and pins.whole()  # in slabs
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
    w = _wrapped(model, torch.randn(8, 24))
    host = _host(w, model, pin=False)
    try:
        with pytest.raises(XschedError, match="pin=module.pins_host") as e:
            w.listen(host)
        assert "\n" not in str(e.value)
    finally:
        host.close()


def test_xsched_train_with_the_parameters_on_the_host_pins_each_weight_once(pins, tmp_path, monkeypatch) -> None:
    """`xsched train --param-home` beside "a GPU": every weight pinned, in power-of-two slabs that the weights and
    their gradient buffers hold (no dead or extra pinned memory, through the steps); checkpoints of the slabs'
    views resume, and the losses are eager AdamW's."""
    built: list[HostAdamW] = []

    class Recorded(HostAdamW):
        def __init__(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003
            super().__init__(*args, **kwargs)
            built.append(self)

    monkeypatch.setattr(optim, "HostAdamW", Recorded)
    path = tmp_path / "mlp.py"
    path.write_text(teacher_mlp(3, 40))
    config = TrainConfig(
        f"{path}:factory",
        {"cpu:0": "100%", "cpu:1": "1GiB"},
        method="offload",
        profile="model",
        cache_dir=str(tmp_path / "cache"),
        param_home="cpu:1",
        stores=("cpu:1",),
        batch=8,
        checkpoint_dir=str(tmp_path / "ck"),
        checkpoint_every=2,
    )
    first = train(dataclasses.replace(config, steps=2))
    rest = train(dataclasses.replace(config, steps=3, resume=True))
    want, model = eager_run(path, batch=8, world=1, steps=3)
    assert_close(first.losses + rest.losses, want, rtol=1e-5, atol=1e-6)
    for host in built:  # each run's optimizer: the weights it packs, and their gradient buffers
        params = [p for b in host.buckets for seg in b.segments for p in seg.params]
        assert len(params) == len(list(model.parameters())) and all(p.is_pinned() for p in params)
        assert all(seg.grad.is_pinned() for b in host.buckets for seg in b.segments)
    assert len(built) == 2 and pins.whole()
    assert pins.dead([t for h in built for b in h.buckets for seg in b.segments for t in [*seg.params, seg.grad]]) == 0


def test_slabs_place_the_largest_first_in_powers_of_two_and_allocate_when_used(monkeypatch) -> None:
    """PinnedSlabs by hand, slabs of at most 4 KiB (1,024 floats), buffers aligned to 16 floats: 600, 500, 300, 100
    and 20 floats (aligned 608, 512, 304, 112, 32; 1,568 in all) go into slabs of 1,024 (600, then 300 at 608 and
    100 at 912), 512 (500: 960 were left) and 32 (20); one more of 10 floats gets a slab of 16. Nothing is pinned
    before its slab's first buffer is asked for."""
    made: list[torch.Tensor] = []
    monkeypatch.setattr(host_pin, "SLAB_BYTES", 4096)
    monkeypatch.setattr(
        host_pin, "pinned_empty", lambda shape, dtype: made.append(torch.empty(shape, dtype=dtype)) or made[-1]
    )
    slabs = host_pin.PinnedSlabs(torch.float32, [20, 600, 100, 500, 300])
    assert made == []
    got = {n: slabs.empty(n) for n in (20, 600, 100, 500, 300, 10)}
    assert [t.numel() for t in made] == [32, 1024, 512, 16]  # in the order first used
    where = {
        n: (next(k for k, m in enumerate(made) if t.untyped_storage().data_ptr() == m.data_ptr()), t.storage_offset())
        for n, t in got.items()
    }
    assert where == {20: (0, 0), 600: (1, 0), 100: (1, 912), 500: (2, 0), 300: (1, 608), 10: (3, 0)}
    assert all(t.numel() == n for n, t in got.items())


def test_the_pinning_bench_counts_the_weights_once_now_and_the_packed_ones_twice_before() -> None:
    """scripts/bench_host_pinning.py on the tiny GPT-2: now every parameter and buffer byte is copied into pinned
    memory once, none of it is dead and torch's rounding adds nothing; before, the packed weights were pinned and
    copied again, their first copies left dead, and every allocation rounded up."""
    sys.path.insert(0, str(ROOT / "scripts"))
    bench = importlib.import_module("bench_host_pinning")
    model = bench.empty_model("gpt2", "tiny")
    held = _nbytes([*model.parameters(), *model.buffers()])
    names = bench.release_order(model, "gpt2", "tiny", "reverse")
    before = bench.setup(model, names, before=True)
    now = bench.setup(bench.empty_model("gpt2", "tiny"), names, before=False)
    assert now["copied into pinned"] == held and now["dead pinned"] == 0
    assert now["all pinned, as torch rounds it"] == now["weights pinned"] + now["gradients pinned"]
    assert before["dead pinned"] > 0 and before["copied into pinned"] == held + before["dead pinned"]
    assert before["all pinned, as torch rounds it"] > now["all pinned, as torch rounds it"]
    assert now["setup's peak: that and the weights not pinned yet"] >= now["all pinned, as torch rounds it"]
