"""Advancing torch's CPU generator (MT19937) by n 32-bit draws without making them: a jump ahead by polynomials."""

from __future__ import annotations

import functools
import struct

import torch

N, M = 624, 397  # MT19937's words of state, and the offset of the word each new word mixes in
UPPER, LOWER, MATRIX_A = 0x80000000, 0x7FFFFFFF, 0x9908B0DF
WORD = 0xFFFFFFFF
# torch's serialized CPU generator state (CPUGeneratorImplState): the seed (u64), `left` (i32), `seeded` (i32),
# `next` (u64), the 624 words (as u64), then the normal samples' cache, 5056 bytes in all
STATE_BYTES, LEFT_AT, NEXT_AT, WORDS_AT = 5056, 8, 16, 24
JUMP_MIN = 1 << 24  # fewer draws are made and dropped (0.1 s); a jump costs 0.2-0.4 s, and 0.4 s more the first time
DEGREE = 19937  # of the characteristic polynomial: MT19937's period is 2^19937 - 1
CHUNK = 1 << 20  # floats per uniform_ when the draws are made


def skip_draws(n: int, generator: torch.Generator | None = None) -> None:
    """Leave `generator` (default torch's global CPU one) where `n` 32-bit draws (a float32 uniform_ of n values)
    would leave it: jumped ahead for many draws, else by making them; the same later numbers either way."""
    gen = generator if generator is not None else torch.default_generator
    if n < JUMP_MIN or len(gen.get_state()) != STATE_BYTES:
        _make_draws(n, gen)
    else:
        gen.set_state(jumped(gen.get_state(), n))


def _make_draws(n: int, gen: torch.Generator) -> None:
    scratch = torch.empty(min(n, CHUNK))
    for start in range(0, n, CHUNK):
        scratch[: min(CHUNK, n - start)].uniform_(generator=gen)  # one 32-bit draw per float32


def jumped(state: torch.Tensor, n: int) -> torch.Tensor:
    """The serialized state `n` draws after `state`. torch twists all 624 words when a draw finds `left` at 1 and
    then hands them out in order; the draws left before that twist are skipped by moving the index, the rest by
    applying the twists they need to the words at once (x^(624 twists) mod the characteristic polynomial)."""
    raw = bytearray(state.numpy().tobytes())
    (left,) = struct.unpack_from("<i", raw, LEFT_AT)
    (nxt,) = struct.unpack_from("<Q", raw, NEXT_AT)
    if n <= left - 1:  # within the words already twisted
        struct.pack_into("<i", raw, LEFT_AT, left - n)
        struct.pack_into("<Q", raw, NEXT_AT, nxt + n)
    else:
        after = n - (left - 1)  # draws after the next twist: `twists` twists, the last one's first `used` words
        twists, used = (after - 1) // N + 1, (after - 1) % N + 1
        words = struct.unpack_from(f"<{N}Q", raw, WORDS_AT)
        packed = sum((w & WORD) << (32 * i) for i, w in enumerate(words))
        struct.pack_into(f"<{N}Q", raw, WORDS_AT, *_unpack(_apply(_power(N * twists), packed)))
        struct.pack_into("<i", raw, LEFT_AT, N + 1 - used)
        struct.pack_into("<Q", raw, NEXT_AT, used)
    return torch.frombuffer(raw, dtype=torch.uint8).clone()


def _step(window: int) -> int:
    """One draw's word on the state as a sliding window (624 words, oldest in the low bits): the oldest drops out
    and the new word enters at the top. Linear over GF(2), as every MT19937 step."""
    y = (window & UPPER) | ((window >> 32) & LOWER)
    new = ((window >> (32 * M)) & WORD) ^ (y >> 1) ^ (MATRIX_A if y & 1 else 0)
    return (window >> 32) | (new << (32 * (N - 1)))


def _unpack(window: int) -> list[int]:
    return [(window >> (32 * i)) & WORD for i in range(N)]


@functools.cache
def _characteristic() -> int:
    """MT19937's characteristic polynomial (bit i: the coefficient of x^i), of degree DEGREE: the minimal polynomial
    of one bit of its words' sequence (Berlekamp-Massey), which is the whole generator's as that is primitive."""
    window = sum(((1812433253 * i + 1) & WORD) << (32 * i) for i in range(N))  # any state with a nonzero sequence
    bits = []
    for _ in range(2 * DEGREE + 2):
        window = _step(window)
        bits.append(window >> (32 * N - 1))  # the new word's top bit
    connection, degree = _berlekamp_massey(bits)
    if degree != DEGREE:  # the step is not MT19937's
        raise RuntimeError(f"the generator's recurrence has degree {degree}, not {DEGREE}")
    # the characteristic polynomial is the connection polynomial's reciprocal: x^L C(1/x)
    return int(f"{connection:0{degree + 1}b}"[::-1], 2)


def _berlekamp_massey(bits: list[int]) -> tuple[int, int]:
    """The shortest linear recurrence over GF(2) generating `bits`: its connection polynomial C (C(0) = 1) and
    length L, so that bits[k] = sum of C_i bits[k - i], i = 1..L."""
    c, b, length, shift, recent = 1, 1, 0, 1, 0  # `recent` bit i - 1: bits[k - i]
    for k, bit in enumerate(bits):
        if bit ^ (((c >> 1) & recent).bit_count() & 1):
            if 2 * length <= k:
                c, b, length, shift = c ^ (b << shift), c, k + 1 - length, 1
            else:
                c, shift = c ^ (b << shift), shift + 1
        else:
            shift += 1
        recent = (recent << 1) | bit
    return c, length


@functools.cache
def _reduction() -> tuple[int, int, list[int], list[int]]:
    """The characteristic polynomial, its degree, and for clearing 8 top bits at once: byte -> the multiplier
    whose product with the polynomial has those top bits, and multiplier -> that product."""
    phi = _characteristic()
    degree = phi.bit_length() - 1
    products = [0] * 256
    for g in range(256):
        for i in range(8):
            if g >> i & 1:
                products[g] ^= phi << i
    multiplier = [0] * 256
    for g, p in enumerate(products):
        multiplier[(p >> degree) & 0xFF] = g
    return phi, degree, multiplier, products


def _mod(a: int) -> int:
    phi, degree, multiplier, products = _reduction()
    top = a.bit_length() - 1
    while top >= degree + 7:  # the top 8 bits cleared by one product, shifted into place
        a ^= products[multiplier[(a >> (top - 7)) & 0xFF]] << (top - 7 - degree)
        top = a.bit_length() - 1
    while top >= degree:
        a ^= phi << (top - degree)
        top = a.bit_length() - 1
    return a


def _spread(byte: int) -> int:
    """The bits of `byte` at the even positions: a square over GF(2) has no cross terms."""
    return sum(1 << (2 * i) for i in range(8) if byte >> i & 1)


_SPREAD = [_spread(b).to_bytes(2, "little") for b in range(256)]


def _square(a: int) -> int:
    data = a.to_bytes((a.bit_length() + 7) // 8 or 1, "little")
    return _mod(int.from_bytes(b"".join(_SPREAD[byte] for byte in data), "little"))


def _power(e: int) -> int:
    """x^e mod the characteristic polynomial."""
    result = 1
    for bit in bin(e)[2:]:
        result = _square(result)
        if bit == "1":
            result = _mod(result << 1)
    return result


def _apply(poly: int, window: int) -> int:
    """p(step) applied to the window (Horner): the window `e` steps on, for p = x^e mod the characteristic
    polynomial (the oldest word's low 31 bits aside, which no later draw reads)."""
    acc = 0
    for k in range(poly.bit_length() - 1, -1, -1):
        acc = _step(acc)
        if poly >> k & 1:
            acc ^= window
    return acc
