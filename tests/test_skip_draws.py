"""Skipping draws of torch's CPU generator (xsched.zoo.skip_draws) gives the numbers the draws would have left, and
the zoo's Llama built on the meta device with its draws skipped has the plain build's weights, bit for bit."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from xsched.zoo import llama, skip_draws


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


ODD = llama.LlamaConfig(2, 4, 2, 20, 40, 37, 16, 10000.0, 8, 2)  # 37 x 20 embedding values: not a multiple of 16


@pytest.mark.parametrize("jump", [False, True])
@pytest.mark.parametrize(
    "cfg", [llama.scales("")["tiny"], llama.scales("")["small"], ODD], ids=["tiny", "small", "odd"]
)
def test_llama_built_on_meta_with_its_draws_skipped_has_the_plain_builds_weights(monkeypatch, cfg, jump) -> None:
    """Llama(cfg) on the CPU draws every Linear twice (torch's init, then the zoo's normal_); the build that draws
    them once has the same parameters and buffers, bit for bit, the head still tied, and leaves the generator where
    the plain build does. `jump`: the draws skipped by the jump ahead (large models), else made."""
    monkeypatch.setattr(skip_draws, "JUMP_MIN", 0 if jump else 1 << 62)
    torch.manual_seed(0)
    plain = llama.Llama(cfg)
    after_plain = torch.rand(100)
    torch.manual_seed(0)
    once = llama._built_once(cfg)
    assert torch.equal(torch.rand(100), after_plain)
    assert once.lm_head.weight is once.embed_tokens.weight
    want, got = plain.state_dict(), once.state_dict()
    assert want.keys() == got.keys()
    for name, t in want.items():
        assert torch.equal(got[name], t), name
    for name in ("cos", "sin", "future"):
        assert torch.equal(getattr(once, name), getattr(plain, name)), name
    assert set(dict(once.named_buffers())) == set(dict(plain.named_buffers())) and "cos" not in got


def test_a_large_llama_takes_the_once_drawn_build_and_small_ones_the_plain_one(monkeypatch) -> None:
    built = []
    monkeypatch.setattr(llama, "_built_once", lambda cfg: built.append(cfg) or llama.Llama(cfg))
    tiny = llama.scales("")["tiny"]
    llama.make_model(tiny)
    big = dataclasses.replace(tiny, vocab=skip_draws.JUMP_MIN // tiny.n_embd)  # its embedding alone reaches JUMP_MIN
    llama.make_model(big)
    with torch.device("meta"):
        llama.make_model(big)  # nothing drawn on the meta device
    assert built == [big]
