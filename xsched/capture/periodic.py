"""Extrapolating a sequence of records that grows by whole periods: the records of a model with k, k+1 blocks
lined up as fixed segments and runs of identical copies, every integer in them affine in the block count and copy.

A record (a Value, an Op, a (name, ref) pair) is read as a *key*, its structure with every integer (int fields, and
the decimal digits inside strings: "v123", "transformer.h.7.mlp", "addmm_42") replaced by a placeholder, and the
vector of those integers. Two graphs of k and k+1 blocks line up when their keys are the same fixed segments and
runs, the k+1 graph holding one more copy of each run; then each integer of a fixed record (and of a run's first
copy) is a + b (n - k), and of the c-th copy of a run a + b (n - k) + g c, fitted on the two graphs and checked
against every copy in them.
Anything that does not line up raises `Mismatch`: the caller then captures the whole model."""

from __future__ import annotations

import dataclasses
import difflib
import functools
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

_DIGITS = re.compile(r"\d+")
_HOLE = "\x00#"  # where an integer was, in a key


class Mismatch(Exception):
    """The graphs do not line up as fixed segments and runs of copies: the caller falls back to a full capture."""


# ---- records as (key, integers) ----
def _canonical(run: str) -> bool:
    """A digit run that int() and str() give back unchanged ("7", not "07"), so it can be refilled."""
    return run == "0" or not run.startswith("0")


@functools.lru_cache(maxsize=1 << 16)  # names, targets and ids repeat across the records and the graphs
def _split(text: str) -> tuple[tuple[str, ...], str, tuple[int, ...]]:
    """The text before each refillable digit run, the text after the last, and the runs' numbers."""
    heads, numbers, last = [], [], 0
    for m in _DIGITS.finditer(text):
        if _canonical(m.group()):
            heads.append(text[last : m.start()])
            numbers.append(int(m.group()))
            last = m.end()
    return tuple(heads), text[last:], tuple(numbers)


def _read(obj: Any, ints: list[int], key: list[str]) -> None:
    if obj is None or isinstance(obj, (bool, float)):
        key.append(repr(obj))
    elif isinstance(obj, int):
        ints.append(obj)
        key.append("i" + _HOLE)
    elif isinstance(obj, str):
        heads, tail, numbers = _split(obj)
        ints.extend(numbers)
        key.append("s" + repr(_HOLE.join([*heads, tail])))
    elif isinstance(obj, (list, tuple)):
        key.append("[" if isinstance(obj, list) else "(")
        for x in obj:
            _read(x, ints, key)
        key.append("]")
    elif isinstance(obj, Mapping):
        key.append("{")
        for k, v in obj.items():
            _read(k, ints, key)
            _read(v, ints, key)
        key.append("}")
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        key.append(type(obj).__qualname__ + "(")
        for f in dataclasses.fields(obj):
            _read(getattr(obj, f.name), ints, key)
        key.append(")")
    else:  # nothing else is in a captured graph; if it were, we could not say how it scales
        raise Mismatch(f"a record holds a {type(obj).__name__}")


Build = Callable[[Iterator[int]], Any]


def builder(obj: Any) -> Build:
    """A function that makes `obj` anew with its integers taken, in `_read`'s order, from an iterator (made once
    per record of a fit, called for each copy: faster than walking the record each time)."""
    if obj is None or isinstance(obj, (bool, float)):
        return lambda ints: obj
    if isinstance(obj, int):
        return next
    if isinstance(obj, str):
        return _string_builder(obj)
    if isinstance(obj, (list, tuple)):
        items = [builder(x) for x in obj]
        if isinstance(obj, list):
            return lambda ints: [b(ints) for b in items]
        return lambda ints: tuple([b(ints) for b in items])
    if isinstance(obj, Mapping):
        pairs = [(builder(k), builder(v)) for k, v in obj.items()]
        return lambda ints: {k(ints): v(ints) for k, v in pairs}
    cls, fields = type(obj), [(f.name, builder(getattr(obj, f.name))) for f in dataclasses.fields(obj)]
    return lambda ints: cls(**{name: b(ints) for name, b in fields})


def _string_builder(text: str) -> Build:
    heads, tail, _ = _split(text)
    if not heads:
        return lambda ints: text
    return lambda ints: "".join([h + _digits(next(ints)) for h in heads]) + tail


def _digits(n: int) -> str:
    if n < 0:  # a name or id would change its shape ("v-3"): the extrapolation left the range it was fitted on
        raise Mismatch("an extrapolated name holds a negative number")
    return str(n)


@dataclass(frozen=True)
class Records:
    """A sequence of records read as keys and integer vectors."""

    items: tuple[Any, ...]
    keys: tuple[str, ...]
    ints: tuple[tuple[int, ...], ...]

    @staticmethod
    def read(items: Sequence[Any], context: Sequence[str] | None = None) -> Records:
        """`context[i]`, where given, joins record i's key: what it refers to (a value's producer), so that records
        alike in themselves ("v12", "v31") line up by what they stand for."""
        keys, ints = [], []
        for n, x in enumerate(items):
            i: list[int] = []
            k: list[str] = []
            _read(x, i, k)
            keys.append("".join(k) + ("|" + context[n] if context is not None else ""))
            ints.append(tuple(i))
        return Records(tuple(items), tuple(keys), tuple(ints))


# ---- layout: fixed segments and runs ----
@dataclass(frozen=True)
class Part:
    """A fixed segment (period 0) of `length` records, or a run of `copies` copies of `length` records."""

    start: int  # in the graph it was found in
    length: int
    copies: int = 0  # 0: a fixed segment


def _region(keys: Sequence[str], lo: int, hi: int) -> tuple[int, int]:
    """The widest stretch around keys[lo:hi] that repeats with period hi - lo."""
    period = hi - lo
    while lo > 0 and keys[lo - 1] == keys[lo - 1 + period]:
        lo -= 1
    while hi < len(keys) and keys[hi] == keys[hi - period]:
        hi += 1
    return lo, hi


def layout(small: Records, big: Records) -> list[Part]:
    """The parts of `big`, whose runs each hold one copy more than in `small` (found where difflib inserts)."""
    ops = difflib.SequenceMatcher(None, small.keys, big.keys, autojunk=False).get_opcodes()
    if any(tag in ("replace", "delete") for tag, *_ in ops):
        raise Mismatch("a record changes between the cut graphs, beyond whole blocks added")
    parts: list[Part] = []
    end = 0
    for tag, _, _, j1, j2 in ops:
        if tag != "insert":
            continue
        lo, hi = _region(big.keys, j1, j2)
        copies = (hi - lo) // (j2 - j1)
        if lo < end or copies < 2:
            raise Mismatch("the added records are not whole copies of a repeated run")
        parts += [Part(end, lo - end), Part(lo, j2 - j1, copies)]
        end = lo + copies * (j2 - j1)
    parts.append(Part(end, len(big.keys) - end))
    return parts


def _shrunk(parts: list[Part]) -> Iterator[tuple[Part, int]]:
    """Each part and where it starts in the graph with one copy less of each run."""
    at = 0
    for p in parts:
        yield p, at
        at += p.length * (p.copies - 1) if p.copies else p.length


# ---- fit and predict ----
Ints = tuple[int, ...]


@dataclass(frozen=True)
class Line:
    """One record of a fixed segment or of a run's copy: how to build it and how its integers grow. A fixed record's,
    and a run's first copy's, are a0 + b0 (n - k); a later copy c's are a + b (n - k) + g c. The first copy stands
    apart because it reads what precedes the run (a block's input is the embedding, not the block before)."""

    build: Build  # the record's builder
    a0: Ints
    b0: Ints
    a: Ints = ()
    b: Ints = ()
    g: Ints = ()

    def ints(self, added: int, copy: int) -> Ints:
        if copy == 0:
            return tuple(x + added * y for x, y in zip(self.a0, self.b0))
        return tuple(x + added * y + copy * z for x, y, z in zip(self.a, self.b, self.g))


@dataclass(frozen=True)
class Fit:
    """The parts of the bigger graph and, per part, one Line per record (of a fixed segment, of a run's copy)."""

    parts: tuple[Part, ...]
    lines: tuple[tuple[Line, ...], ...]


def fit(small: Records, big: Records) -> Fit:
    """Line up two graphs one block apart and fit every integer; raises Mismatch where any record disagrees."""
    parts = layout(small, big)
    if sum(p.length * (p.copies - 1) if p.copies else p.length for p in parts) != len(small.keys):
        raise Mismatch("the cut graphs differ by more than whole copies")
    if any(0 < p.copies < 3 for p in parts):  # beyond the first copy, copies 1 and 2 of big fit g, 1 of small b
        raise Mismatch("a repeated run has too few copies in the cut graphs (cut more blocks)")
    return Fit(
        tuple(parts), tuple(tuple(_line(small, at, big, p, t) for t in range(p.length)) for p, at in _shrunk(parts))
    )


def _line(small: Records, at: int, big: Records, p: Part, t: int) -> Line:
    """Record t of part p, which starts at `at` in `small`, fitted and checked against every copy in both graphs."""
    i, j, n = at + t, p.start + t, p.length  # the record's first copy in small, in big; the copies' stride
    _same_key(small, i, big, j)
    first = Line(builder(big.items[j]), small.ints[i], _sub(big.ints[j], small.ints[i]))
    if not p.copies:
        return first
    g = _sub(big.ints[j + 2 * n], big.ints[j + n])
    a = _sub(small.ints[i + n], g)
    line = dataclasses.replace(first, a=a, b=_sub(big.ints[j + n], small.ints[i + n]), g=g)
    for c in range(1, p.copies):
        _same_key(big, j, big, j + c * n)
        _check(big, j + c * n, line.ints(1, c))
        if c < p.copies - 1:
            _same_key(big, j, small, i + c * n)
            _check(small, i + c * n, line.ints(0, c))
    return line


def predict(f: Fit, blocks_added: int) -> list[Any]:
    """The records of the graph `blocks_added` blocks beyond the fit's smaller one."""
    out = []
    for p, lines in zip(f.parts, f.lines):
        for c in range(p.copies - 1 + blocks_added if p.copies else 1):
            out += [line.build(iter(line.ints(blocks_added, c))) for line in lines]
    return out


def _sub(x: tuple[int, ...], y: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(p - q for p, q in zip(x, y))


def _same_key(r: Records, i: int, s: Records, j: int) -> None:
    if r.keys[i] != s.keys[j]:
        raise Mismatch("a record changes between the cut graphs, beyond whole blocks added")


def _check(r: Records, i: int, want: tuple[int, ...]) -> None:
    if r.ints[i] != want:
        raise Mismatch("a record's numbers do not grow by the same step with each block")
