"""The peak a compiled region's code allocates, read from inductor's generated wrapper before it runs.

Inductor's wrapper (`call(self, args)`) allocates each buffer by an `empty_strided_<device>` line, renames or views
buffers (`buf3 = buf1; del buf1  # reuse`, `reinterpret_tensor(...)`), and frees them (and the boxed inputs, at
their last use) by `del`; its kernels write into what it allocated. Replaying those lines gives the most bytes live
above the call's start, before any run: on gpt2 small (CPU) it equals the allocator's count of every region. A
line it cannot account for (a fallback op allocating its own output, a statement it does not know) gives None:
the region is then only measured when it runs.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import torch

_ALLOC = re.compile(r"empty_strided_\w+\(\(([^()]*)\), \(([^()]*)\), torch\.(\w+)\)$")
_VIEW = re.compile(r"reinterpret_tensor\((\w+),")
_NAME = re.compile(r"\w+$")
_ASSIGN = re.compile(r"(\w+) = (.+)$")
# assignments that bind no tensor of the region's (a CUDA stream)
_NOT_TENSORS = ("get_raw_stream(",)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _storage_bytes(shape: list[int], stride: list[int], dtype: str) -> int:
    if any(n == 0 for n in shape):
        return 0
    return (1 + sum((n - 1) * s for n, s in zip(shape, stride))) * getattr(torch, dtype).itemsize


def _call_body(source: str) -> list[str] | None:
    """The statements of the wrapper's `call`, one per item (`a; b` split, comments dropped)."""
    lines = source.splitlines()
    start = next((k for k, ln in enumerate(lines) if ln.strip() == "def call(self, args):"), None)
    if start is None:
        return None
    indent = None
    out: list[str] = []
    for ln in lines[start + 1 :]:
        if not ln.strip():
            continue
        depth = len(ln) - len(ln.lstrip())
        indent = depth if indent is None else indent
        if depth < indent:
            break
        code = ln.split("  #")[0].strip()
        out += [s.strip() for s in code.split(";") if s.strip() and not s.strip().startswith("#")]
    return out


def code_peak(source: str, inputs: Sequence[torch.Tensor], dying: Sequence[bool]) -> int | None:
    """The most bytes live during the wrapper `source`'s call above what was live when it began: its buffers as
    allocated, renamed and deleted, less each input of `dying` (the call holds its only reference) from the `del`
    of its argument on. None when some statement may allocate in a way this does not follow."""
    body = _call_body(source)
    if body is None:
        return None
    owner: dict[str, int] = {}  # name -> storage id
    size: dict[int, int] = {}
    refs: dict[int, int] = {}
    for k, (t, dies) in enumerate(zip(inputs, dying)):
        if dies:  # a storage that leaves when its argument is deleted
            owner[f"arg{k}_1"] = k
            size[k], refs[k] = t.untyped_storage().nbytes(), 1
    now = peak = 0
    fresh = len(inputs)
    for stmt in body:
        if stmt.startswith("del "):
            for name in (n.strip() for n in stmt[4:].split(",")):
                sid = owner.pop(name, None)
                if sid is not None:
                    refs[sid] -= 1
                    if refs[sid] == 0:
                        now -= size[sid]
            continue
        m = _ASSIGN.match(stmt)
        if m is None:
            continue  # a kernel call, an assert, `args.clear()`, the unpacking of args, return: no allocation
        name, rhs = m.groups()
        alloc = _ALLOC.search(rhs)
        view = _VIEW.match(rhs)
        if alloc and rhs.startswith("empty_strided_"):
            try:
                nbytes = _storage_bytes(_ints(alloc.group(1)), _ints(alloc.group(2)), alloc.group(3))
            except (ValueError, AttributeError):  # a symbolic size, a dtype torch does not name so
                return None
            fresh += 1
            owner[name], refs[fresh] = fresh, 1
            size[fresh] = nbytes
            now += size[fresh]
            peak = max(peak, now)
        elif view or _NAME.match(rhs):
            base = view.group(1) if view else rhs
            if base in owner:
                owner[name] = owner[base]
                refs[owner[base]] += 1
        elif not rhs.startswith(_NOT_TENSORS):
            return None
    return peak
