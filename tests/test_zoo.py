"""Model zoo: every workload builds, trains a step, is reproducible, has published sizes and traces for capture."""

from __future__ import annotations

import math

import pytest
import torch
from torch.func import functional_call
from torch.fx.experimental.proxy_tensor import make_fx

from xsched import zoo
from xsched.errors import XschedError

ALL = ["gpt2", "llama", "mlp_mixer", "resnet18", "resnet34", "resnet50", "transformer", "unet", "vgg16", "vgg19"]

# published parameter counts: torchvision (ResNet, VGG), HF/OpenAI GPT-2 small, timm mixer_b16_224
PUBLISHED = {
    "resnet18": 11_689_512,
    "resnet34": 21_797_672,
    "resnet50": 25_557_032,
    "vgg16": 138_357_544,
    "vgg19": 143_667_240,
    "gpt2": 124_439_808,
    "mlp_mixer": 59_880_472,
}


def _loss(out: torch.Tensor | tuple) -> torch.Tensor:
    # gpt2 returns (logits, loss); the rest return logits, reduced to a scalar as a stand-in loss
    return out[1] if isinstance(out, tuple) else out.pow(2).mean()


def _joint(z: zoo.ZooModel):
    """A pure function (params, buffers, *inputs) -> (loss, grads), the shape capture traces."""
    names = [k for k, _ in z.model.named_parameters()]

    def step(params, buffers, *inputs):
        loss = _loss(functional_call(z.model, {**params, **buffers}, inputs))
        return loss, torch.autograd.grad(loss, [params[k] for k in names])

    return step, dict(z.model.named_parameters()), dict(z.model.named_buffers())


def test_names_sorted_and_complete():
    assert zoo.names() == sorted(ALL)


@pytest.mark.parametrize("name", ALL)
def test_tiny_trains_one_step_with_finite_nonzero_grads(name):
    z = zoo.build(name, scale="tiny")
    assert z.name == name and z.model.training
    assert all(p.dtype == torch.float32 for p in z.model.parameters())
    _loss(z.model(*z.inputs)).backward()
    for k, p in z.model.named_parameters():
        assert p.grad is not None, k
        assert torch.isfinite(p.grad).all(), k
        assert p.grad.abs().gt(0).any(), f"{name}.{k} got an all-zero gradient"


@pytest.mark.parametrize("name", ALL)
def test_builds_are_identical_and_leave_global_rng_alone(name):
    before = torch.get_rng_state()
    a, b = zoo.build(name, scale="tiny"), zoo.build(name, scale="tiny")
    assert torch.equal(before, torch.get_rng_state())
    sa, sb = a.model.state_dict(), b.model.state_dict()
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert len(a.inputs) == len(b.inputs) and all(torch.equal(x, y) for x, y in zip(a.inputs, b.inputs))


@pytest.mark.parametrize("name", ALL)
def test_batch_override(name):
    z = zoo.build(name, batch=3, scale="tiny")
    assert all(x.shape[0] == 3 for x in z.inputs)
    assert zoo.build(name, scale="tiny").inputs[0].shape[0] == zoo.config(name, "tiny").batch


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_full_parameter_counts_match_published(name):
    model = zoo.build_module(name, "full", device="meta")
    assert sum(p.numel() for p in model.parameters()) == PUBLISHED[name]


def test_scales_grow():
    for name in ALL:
        counts = [sum(p.numel() for p in zoo.build_module(name, s, device="meta").parameters()) for s in zoo.SCALES]
        assert counts == sorted(counts) and counts[0] < counts[-1], (name, counts)


def test_unet_concatenates_skips_and_keeps_resolution():
    z = zoo.build("unet", scale="tiny")
    cfg = zoo.config("unet", "tiny")
    (x,) = z.inputs
    out = z.model(x)
    assert out.shape == (x.shape[0], cfg.classes, x.shape[2], x.shape[3])
    for up in z.model.decoder:  # the conv after each upsampling sees the upsampled map plus the skip
        assert up.block[0].in_channels == 2 * up.up.out_channels
    assert isinstance(z.model.encoder[0][1], torch.nn.InstanceNorm2d)
    params = dict(z.model.named_parameters())
    g = make_fx(lambda p, img: functional_call(z.model, p, (img,)), tracing_mode="fake")(params, x)
    assert sum(n.target == torch.ops.aten.cat.default for n in g.graph.nodes) == cfg.depth


@pytest.mark.parametrize("name", ALL)
def test_joint_graph_traces_with_fake_tensors(name):
    z = zoo.build(name, scale="tiny")
    step, params, buffers = _joint(z)
    g = make_fx(step, tracing_mode="fake")(params, buffers, *z.inputs)
    targets = {str(n.target) for n in g.graph.nodes if n.op == "call_function"}
    assert not any("nested" in t for t in targets), targets
    placeholders = [n for n in g.graph.nodes if n.op == "placeholder"]
    assert len(placeholders) == len(params) + len(buffers) + len(z.inputs)


@pytest.mark.parametrize("name", ["resnet18", "unet", "mlp_mixer"])
def test_traced_joint_graph_matches_eager(name):
    # dropout-free models, so eager and traced runs must agree exactly up to float reassociation
    z, ref = zoo.build(name, scale="tiny"), zoo.build(name, scale="tiny")
    step, params, buffers = _joint(z)
    g = make_fx(step)(params, {k: v.clone() for k, v in buffers.items()}, *z.inputs)
    loss, grads = g(params, buffers, *z.inputs)
    ref_loss = _loss(ref.model(*ref.inputs))
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss)
    for got, (k, p) in zip(grads, ref.model.named_parameters()):
        torch.testing.assert_close(got, p.grad, msg=k)
    for k, v in ref.model.named_buffers():  # batch-norm running statistics moved the same way
        torch.testing.assert_close(buffers[k], v, msg=k)


def test_transformer_captures_through_aot_autograd():
    from torch._functorch.aot_autograd import aot_function, make_boxed_func

    z = zoo.build("transformer", scale="tiny")
    params, buffers = dict(z.model.named_parameters()), dict(z.model.named_buffers())
    graphs: list[torch.fx.GraphModule] = []

    def keep(gm, _example):
        graphs.append(gm)
        return make_boxed_func(gm)

    f = aot_function(lambda p, b, s, t: _loss(functional_call(z.model, {**p, **b}, (s, t))), keep, keep)
    f(params, buffers, *z.inputs).backward()
    assert len(graphs) == 2  # forward and backward, no graph break, no data-dependent guard
    fwd = {str(n.target) for n in graphs[0].graph.nodes}
    assert not any("nested" in t or "transformer_encoder_layer_fwd" in t for t in fwd)  # fast path not taken
    assert any("dropout" in t or "bernoulli" in t for t in fwd)  # dropout is live in train mode
    assert all(torch.isfinite(p.grad).all() for p in params.values())


def test_gpt_logits_loss_causality_and_tying():
    z = zoo.build("gpt2", scale="tiny")
    cfg = zoo.config("gpt2", "tiny")
    idx, targets = z.inputs
    assert idx.dtype == targets.dtype == torch.int64
    assert int(idx.max()) < cfg.vocab and torch.equal(idx[:, 1:], targets[:, :-1])
    logits, loss = z.model(idx, targets)
    assert logits.shape == (idx.shape[0], idx.shape[1], cfg.vocab)
    assert abs(loss.item() - math.log(cfg.vocab)) < 0.5  # near-uniform predictions at init
    assert z.model.lm_head.weight is z.model.wte.weight
    assert "h.0.attn.future" not in z.model.state_dict()
    z.model.eval()  # no dropout, so only the mask can make earlier positions depend on later ones
    changed = idx.clone()
    changed[:, -1] = (changed[:, -1] + 1) % cfg.vocab
    a, _ = z.model(idx)
    b, _ = z.model(changed)
    torch.testing.assert_close(a[:, :-1], b[:, :-1])
    assert not torch.allclose(a[:, -1], b[:, -1])


def test_gpt_class_direct_use_and_layer_knob():
    model = zoo.GPT(n_layer=3, n_head=2, n_embd=16, block_size=8, vocab=20)
    logits, loss = model(torch.zeros(1, 8, dtype=torch.int64))
    assert logits.shape == (1, 8, 20) and loss is None
    assert len(zoo.build("gpt2", scale="tiny:n_layer=5").model.h) == 5
    with pytest.raises(ValueError, match="block_size"):
        model(torch.zeros(1, 9, dtype=torch.int64))


def test_overrides_apply_to_any_config_field():
    z = zoo.build("resnet18", scale="tiny:image=48,classes=7")
    assert z.inputs[0].shape[-1] == 48 and z.model(*z.inputs).shape == (2, 7)
    assert zoo.config("vgg16", "tiny:convs=1x1x1x1x1").convs == (1, 1, 1, 1, 1)


@pytest.mark.parametrize(
    "name, batch, scale, match",
    [
        ("resnet101", None, "tiny", "unknown model 'resnet101'"),
        ("resnet18", None, "huge", "unknown scale 'huge'"),
        ("resnet18", None, "tiny:depth=3", "bad override 'depth=3'"),
        ("resnet18", None, "tiny:width", "bad override 'width'"),
        ("gpt2", None, "tiny:n_layer=two", "bad value 'two'"),
        ("gpt2", None, "tiny:seq=64", "exceeds block_size"),
        ("unet", None, "tiny:image=36", "not divisible"),
        ("vgg16", 0, "tiny", "batch must be a positive int"),
    ],
)
def test_bad_requests_raise_zoo_errors(name, batch, scale, match):
    with pytest.raises(zoo.ZooError, match=match) as info:
        zoo.build(name, batch=batch, scale=scale)
    assert isinstance(info.value, XschedError) and info.value.stage == "zoo"
