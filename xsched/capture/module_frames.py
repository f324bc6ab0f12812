"""Which module (path, class) was active at each traced FX node; tracing failures located at the user's file:line; the
compiling flag libraries read while we trace."""

from __future__ import annotations

import bisect
import contextlib
import sysconfig
import traceback
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException
from torch.fx.experimental.proxy_tensor import get_proxy_mode
from torch.overrides import TorchFunctionMode

from xsched.errors import CaptureError


class ModuleTracker:
    """Module path and class active when each FX node was created (via global module hooks)."""

    def __init__(self, model: nn.Module) -> None:
        self.names = {id(m): (name, type(m).__name__) for name, m in model.named_modules()}
        self.stack: list[tuple[str, str]] = []
        self.events: list[tuple[int, tuple[tuple[str, str], ...]]] = []
        self._index: tuple[list[int], list[tuple[tuple[str, str], ...]]] | None = None

    def graph_len(self) -> int:
        mode = get_proxy_mode()
        return len(mode.tracer.graph.nodes) if mode is not None else -1

    def _enter(self, path: str, cls: str) -> None:
        self.stack.append((path, cls))
        self.events.append((self.graph_len(), tuple(self.stack)))

    def _exit(self) -> None:
        if self.stack:
            self.stack.pop()
            self.events.append((self.graph_len(), tuple(self.stack)))

    def _pre(self, module: nn.Module, args: Any) -> None:
        if id(module) in self.names:
            self._enter(*self.names[id(module)])

    def _post(self, module: nn.Module, args: Any, out: Any) -> None:
        if id(module) in self.names:
            self._exit()

    def active(self) -> _Hooks:
        return _Hooks(self)

    def node_module(self, index: int) -> tuple[tuple[str, str], ...]:
        """(path, class) stack, outermost first, active when the index-th traced node was created."""
        if self._index is None:
            events = [e for e in self.events if e[0] >= 0]
            self._index = ([at for at, _ in events], [stack for _, stack in events])
        at, stacks = self._index
        k = bisect.bisect_right(at, index)
        return stacks[k - 1] if k else ()


class _Hooks:
    def __init__(self, tracker: ModuleTracker) -> None:
        self.tracker = tracker

    def __enter__(self) -> None:
        self.tracker.stack.clear()
        self.tracker.events.clear()
        self.tracker._index = None
        self.handles = [
            nn.modules.module.register_module_forward_pre_hook(self.tracker._pre),
            nn.modules.module.register_module_forward_hook(self.tracker._post),
        ]
        self.mode = _LossFunctions(self.tracker)
        self.mode.__enter__()

    def __exit__(self, *exc: Any) -> None:
        self.mode.__exit__(*exc)
        for h in self.handles:
            h.remove()


_LOSS_FNS = {"cross_entropy", "binary_cross_entropy", "binary_cross_entropy_with_logits", "kl_div"}


class _LossFunctions(TorchFunctionMode):
    """Marks the ops traced inside functional losses (F.cross_entropy, F.mse_loss, ...) as a "Loss" frame."""

    def __init__(self, tracker: ModuleTracker) -> None:
        super().__init__()
        self.tracker = tracker

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = getattr(func, "__name__", "")
        is_loss = getattr(func, "__module__", "") == "torch.nn.functional" and (
            name.endswith("_loss") or name in _LOSS_FNS
        )
        if not is_loss:
            return func(*args, **(kwargs or {}))
        path = self.tracker.stack[-1][0] if self.tracker.stack else ""
        self.tracker._enter(path, f"F.{name}:Loss")
        out = func(*args, **(kwargs or {}))
        self.tracker._exit()
        return out


class located:
    """Turn any failure while tracing into a CaptureError naming the user's file:line and module path."""

    def __init__(self, modules: ModuleTracker) -> None:
        self.modules = modules

    def __enter__(self) -> None:
        pass

    def __exit__(self, kind: type | None, exc: BaseException | None, tb: Any) -> None:
        if exc is None or not isinstance(exc, Exception):
            return
        path = (self.modules.stack[-1][0] if self.modules.stack else "") or "<root>"
        where = _user_frame(exc)
        if getattr(exc, "located", False):
            return
        if isinstance(exc, CaptureError):
            raise _mark(CaptureError(f"{exc.detail} at {where} in module {path}")) from exc
        if (
            isinstance(exc, (DataDependentOutputException, DynamicOutputShapeException))
            or "data-dependent" in str(exc).lower()
        ):
            why = "data-dependent control flow or shape (a Python branch on a tensor value, .item(), nonzero, boolean masking)"
        else:
            why = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        raise _mark(CaptureError(f"cannot capture: {why} at {where} in module {path}")) from exc


def _mark(e: CaptureError) -> CaptureError:
    e.located = True  # type: ignore[attr-defined]
    return e


_SKIP_DIRS = tuple(
    str(Path(p).resolve())
    for p in (Path(torch.__file__).parent, Path(__file__).parent.parent, sysconfig.get_paths()["stdlib"])
)


def _user_frame(exc: BaseException) -> str:
    """file:line of the innermost traceback frame outside torch, xsched and the standard library."""
    frames = traceback.extract_tb(exc.__traceback__)
    cause = exc.__cause__ or exc.__context__
    if cause is not None:
        frames = frames + traceback.extract_tb(cause.__traceback__)
    user = [f for f in frames if not str(Path(f.filename).resolve()).startswith(_SKIP_DIRS)]
    f = user[-1] if user else (frames[-1] if frames else None)
    return f"{f.filename}:{f.lineno}" if f else "<unknown>"


@contextlib.contextmanager
def compiler_tracing() -> Any:
    """torch.compiler.is_compiling() is True while we trace, as in torch.export's non-strict tracing (make_fx too):
    libraries then take their traceable paths instead of eager-only checks a fake tensor cannot answer, e.g.
    transformers' test of the position ids for packed sequences (a branch on a tensor value)."""
    old = torch.compiler._is_compiling_flag
    torch.compiler._is_compiling_flag = True
    try:
        yield
    finally:
        torch.compiler._is_compiling_flag = old
