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
from dataclasses import dataclass

import torch

_ALLOC = re.compile(r"empty_strided_\w+\(\(([^()]*)\), \(([^()]*)\), torch\.(\w+)\)$")
_VIEW = re.compile(r"reinterpret_tensor\((\w+),")
_NAME = re.compile(r"\w+$")
_ARG = re.compile(r"arg(\d+)_1$")
_ARG_IN = re.compile(r"\barg(\d+)_1\b")
_TENSOR_ARG = re.compile(r"\((.*\b)?(arg\d+_1|buf\d+)\b")
# calls that run no kernel of the region's
_NOT_KERNELS = ("assert_", "del ", "return ", "args.clear(")
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


@dataclass(frozen=True)
class CodePeak:
    """Where a wrapper's call peaks: its bytes above the call's start, the inputs it has deleted by then and the
    returned values whose storage it has allocated by then (indices into its args and its return tuple), the
    returned value whose allocation reached the peak (None: a buffer it frees before returning), and the inputs
    that the kernel run at the peak (the first call after it, which writes what was allocated) reads."""

    bytes: int
    inputs_gone: frozenset[int]
    outputs_made: frozenset[int]
    peak_output: int | None
    peak_reads: frozenset[int]


def code_peak(source: str, inputs: Sequence[torch.Tensor], dying: Sequence[bool]) -> int | None:
    """The most bytes live during the wrapper `source`'s call above what was live when it began: its buffers as
    allocated, renamed and deleted, less each input of `dying` (the call holds its only reference) from the `del`
    of its argument on. None when some statement may allocate in a way this does not follow."""
    at = code_peak_at(source, inputs, dying)
    return None if at is None else at.bytes


def code_peak_at(source: str, inputs: Sequence[torch.Tensor], dying: Sequence[bool]) -> CodePeak | None:
    """`code_peak` with where in the call it is reached (`CodePeak`); None where `code_peak` is."""
    body = _call_body(source)
    if body is None:
        return None
    owner: dict[str, int] = {}  # name -> storage id (the inputs' first, then allocation order)
    size: dict[int, int] = {}
    refs: dict[int, int] = {}
    for k, (t, dies) in enumerate(zip(inputs, dying)):
        if dies:  # a storage that leaves when its argument is deleted
            owner[f"arg{k}_1"] = k
            size[k], refs[k] = t.untyped_storage().nbytes(), 1
    now = peak = 0
    fresh = len(inputs)
    at_peak = fresh  # the last storage allocated when the peak was reached
    gone: set[int] = set()  # inputs deleted so far
    gone_at_peak: frozenset[int] = frozenset()
    returned: list[int | None] = []
    reads: frozenset[int] | None = None  # the inputs the kernel after the peak reads (None: not reached yet)
    for stmt in body:
        if reads is None and _is_kernel(stmt):
            reads = frozenset(int(k) for k in _ARG_IN.findall(stmt))
        if stmt.startswith("return "):
            returned = [_storage_of(x, owner) for x in _returned_names(stmt)]
            continue
        if stmt.startswith("del "):
            for name in (n.strip() for n in stmt[4:].split(",")):
                if (arg := _ARG.match(name)) is not None:
                    gone.add(int(arg.group(1)))
                sid = owner.pop(name, None)
                if sid is not None:
                    refs[sid] -= 1
                    if refs[sid] == 0:
                        now -= size[sid]
            continue
        m = _ASSIGN.match(stmt)
        if m is None:
            continue  # a kernel call, an assert, `args.clear()`, the unpacking of args: no allocation
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
            if now > peak:
                peak, at_peak, gone_at_peak, reads = now, fresh, frozenset(gone), None
        elif view or _NAME.match(rhs):
            base = view.group(1) if view else rhs
            if base in owner:
                owner[name] = owner[base]
                refs[owner[base]] += 1
        elif not rhs.startswith(_NOT_TENSORS):
            return None
    made = frozenset(k for k, sid in enumerate(returned) if sid is not None and len(inputs) < sid <= at_peak)
    peak_output = next((k for k, sid in enumerate(returned) if sid == at_peak and peak > 0), None)
    return CodePeak(peak, gone_at_peak, made, peak_output, reads or frozenset())


def _is_kernel(stmt: str) -> bool:
    """A statement that runs a kernel on the region's tensors (`cpp_fused_0(...)`, `extern_kernels.mm(...)`,
    `triton_...run(...)`; not `torch.cuda.set_device(0)`)."""
    return _ASSIGN.match(stmt) is None and not stmt.startswith(_NOT_KERNELS) and _TENSOR_ARG.search(stmt) is not None


def _returned_names(stmt: str) -> list[str]:
    """The names (or the bases of views) a `return (a, reinterpret_tensor(b, ...), )` returns, in order."""
    items, depth, cur = [], 0, ""
    for ch in stmt[len("return ") :].strip().removeprefix("(").removesuffix(")"):
        depth += (ch in "([") - (ch in ")]")
        if ch == "," and depth == 0:
            items.append(cur.strip())
            cur = ""
        else:
            cur += ch
    items.append(cur.strip())
    return [x for x in items if x]


def _storage_of(expr: str, owner: dict[str, int]) -> int | None:
    view = _VIEW.match(expr)
    name = view.group(1) if view else expr
    return owner.get(name)
