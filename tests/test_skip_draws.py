"""Skipping draws of torch's CPU generator (xsched.zoo.skip_draws) gives the numbers the draws would have left, and
the zoo's Llama and GPT-2 built on the meta device with their draws skipped (xsched.zoo.drawn_once) have the plain
builds' weights, bit for bit."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from xsched import zoo
from xsched.zoo import drawn_once, gpt, llama, skip_draws


def drawn(n: int, before: int) -> torch.Generator:
    """A generator seeded 0 after `before` and then `n` float32 uniform_ draws, made."""
    g = torch.Generator().manual_seed(0)
    for count in (before, n):
        if count:
            torch.empty(count).uniform_(generator=g)
    return g


# draws before, draws skipped: within the twisted words, up to and across the twists (624 words each), many twists
CASES = [(0, 0), (0, 1), (0, 624), (0, 625), (1, 622), (1, 623), (623, 1), (700, 1248), (700, 1249), (5000, 300_001)]


@pytest.mark.parametrize(("before", "n"), CASES)
def test_a_jump_leaves_the_generator_where_the_draws_would(before: int, n: int) -> None:
    g = drawn(0, before)
    g.set_state(skip_draws.jumped(g.get_state(), n))
    want = drawn(n, before)
    assert torch.equal(torch.rand(2000, generator=g), torch.rand(2000, generator=want))  # floats: one draw each
    assert torch.equal(torch.randn(2000, generator=g), torch.randn(2000, generator=want))


def test_skip_draws_jumps_for_many_draws_and_makes_few(monkeypatch) -> None:
    jumps = []
    real = skip_draws.jumped
    monkeypatch.setattr(skip_draws, "jumped", lambda state, n: jumps.append(n) or real(state, n))
    for n in (10, skip_draws.JUMP_MIN):
        g = torch.Generator().manual_seed(0)
        skip_draws.skip_draws(n, g)
        assert torch.equal(torch.rand(100, generator=g), torch.rand(100, generator=drawn(n, 0)))
    assert jumps == [skip_draws.JUMP_MIN]


ODD_LLAMA = llama.LlamaConfig(2, 4, 2, 20, 40, 37, 16, 10000.0, 8, 2)  # 37 x 20 embedding values: not a multiple of 16
# 37 x 20 and 13 x 20 embedding values: neither a multiple of 16
ODD_GPT = gpt.GPTConfig(n_layer=2, n_head=2, n_embd=20, block_size=13, vocab=37, seq=8, batch=2)
BUILDS = [
    (llama, llama.scales("")["tiny"]),
    (llama, llama.scales("")["small"]),
    (llama, ODD_LLAMA),
    (gpt, gpt.scales("")["tiny"]),
    (gpt, gpt.scales("")["small"]),
    (gpt, ODD_GPT),
    (gpt, zoo.config("gpt2", "full:n_layer=1")),  # GPT-2's vocabulary and width: 9e7 draws, a jump at JUMP_MIN
]


def ties(model: torch.nn.Module) -> list[list[str]]:
    """The names of each parameter held under more than one name."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return [group for group in names.values() if len(group) > 1]


@pytest.mark.parametrize("jump", [False, True])
@pytest.mark.parametrize(
    ("family", "cfg"),
    BUILDS,
    ids=["llama-tiny", "llama-small", "llama-odd", "gpt-tiny", "gpt-small", "gpt-odd", "gpt-L1"],
)
def test_a_zoo_model_built_on_meta_with_its_draws_skipped_has_the_plain_builds_weights(
    monkeypatch, family, cfg, jump
) -> None:
    """The zoo's models on the CPU draw every Linear twice (torch's init, then the zoo's normal_); the build that
    draws them once has the same parameters and buffers, bit for bit, the same ties, and leaves the generator where
    the plain build does. `jump`: the draws skipped by the jump ahead (large models), else made."""
    monkeypatch.setattr(skip_draws, "JUMP_MIN", 1 << 62)  # the plain build
    torch.manual_seed(0)
    plain = family.make_model(cfg)
    after_plain = torch.rand(100)
    monkeypatch.setattr(drawn_once, "built", drawn_once.built_once)
    monkeypatch.setattr(skip_draws, "JUMP_MIN", 0 if jump else 1 << 62)
    torch.manual_seed(0)
    once = family.make_model(cfg)
    assert torch.equal(torch.rand(100), after_plain)
    assert ties(once) == ties(plain) != []
    want, got = plain.state_dict(), once.state_dict()
    assert want.keys() == got.keys()
    for name, t in want.items():
        assert torch.equal(got[name], t), name
    want, got = dict(plain.named_buffers()), dict(once.named_buffers())
    assert want.keys() == got.keys()
    for name, t in want.items():  # the ones not in state dicts too: masks, rotary tables
        assert torch.equal(got[name], t), name


@pytest.mark.parametrize("family", [llama, gpt], ids=["llama", "gpt"])
def test_a_large_model_takes_the_once_drawn_build_and_small_ones_the_plain_one(monkeypatch, family) -> None:
    """Built once only on the CPU in float32 (the draws counted are float32's) with at least JUMP_MIN draws."""
    built = []
    real = drawn_once.built_once
    monkeypatch.setattr(drawn_once, "built_once", lambda *a: built.append(a[1]) or real(*a))
    monkeypatch.setattr(skip_draws, "JUMP_MIN", 1 << 20)  # a large model, built in a test's time
    tiny = family.scales("")["tiny"]
    family.make_model(tiny)
    big = dataclasses.replace(tiny, vocab=skip_draws.JUMP_MIN // tiny.n_embd)  # its embedding alone reaches JUMP_MIN
    family.make_model(big)
    with torch.device("meta"):
        family.make_model(big)  # nothing drawn on the meta device
    with torch.device("cpu"):
        torch.set_default_dtype(torch.float64)  # draws otherwise (64 bits a value)
        try:
            family.make_model(big)
        finally:
            torch.set_default_dtype(torch.float32)
    assert built == [family._init_draws(big)]
