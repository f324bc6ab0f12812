"""The `xsched` command: one module per group of verbs, each adding its parsers; argparse lives here only.

A user mistake (a bad flag value, a missing or corrupt file, an infeasible budget) is one line on stderr and
exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from typing import NoReturn

LOADED = time.perf_counter()  # the command's clock when this process is the command: before its imports

from xsched.cli import demo, graph, plan, profile, report, run, train  # noqa: E402 (after LOADED)
from xsched.errors import XschedError  # noqa: E402

# devices, profile | capture, import | plan, simulate | run | report | train | demo
VERBS = (profile, graph, plan, run, report, train, demo)


class _Parser(argparse.ArgumentParser):
    """argparse with a one-line error (its default prints the whole usage first); `--help` keeps the usage."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="xsched", description="Heterogeneous CPU/GPU scheduling of training graphs.")
    sub = ap.add_subparsers(dest="command", required=True)
    for verb in VERBS:
        verb.add(sub)
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command: `argv`, or this process's own command line (None), whose clock then started when this
    module loaded (a verb's time limit covers the imports and reading its files)."""
    started = LOADED if argv is None else time.perf_counter()
    args = build_parser().parse_args(argv)
    args.started = started
    args.argv = list(sys.argv[1:] if argv is None else argv)  # the command as given, for reports to quote
    try:
        return int(args.run(args))
    except XschedError as e:
        print(f"xsched: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a missing or unreadable file named on the command line
        print(f"xsched: error: {e.strerror or e}: {e.filename or ''}".rstrip(": "), file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
