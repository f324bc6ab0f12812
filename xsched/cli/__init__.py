"""The `xsched` command: one module per group of verbs, each adding its parsers; argparse lives here only.

A user mistake (a bad flag value, a missing or corrupt file, an infeasible budget) is one line on stderr and
exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from xsched.cli import demo, graph, plan, profile, run, train
from xsched.errors import XschedError

# devices, profile | capture, import | plan, simulate | run | train | demo
VERBS = (profile, graph, plan, run, train, demo)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="xsched", description="Heterogeneous CPU/GPU scheduling of training graphs.")
    sub = ap.add_subparsers(dest="command", required=True)
    for verb in VERBS:
        verb.add(sub)
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
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
