"""Atomic file writes: a temp file beside the target, fsync, rename; a reader sees the old file or the new one."""

from __future__ import annotations

import contextlib
import errno
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO


def atomic_write(path: str | Path, write: Callable[[IO[bytes]], None]) -> Path:
    """Write `path` through `write(file)` into a temp file beside it, fsync it, then rename it over `path`: a
    reader sees the old file or the whole new one, never a part; an interrupted write removes its temp file."""
    path = Path(path)
    if path.is_dir():  # else the rename fails naming the temp file, not the path asked for
        raise IsADirectoryError(errno.EISDIR, "cannot write a file over a directory", str(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return path
