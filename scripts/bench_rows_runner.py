"""Benchmark rows each in a child process of their script (scripts/bench_gpu_param_offload.py and the scripts that
share its rows): the child runs one row and writes its result as JSON, the parent runs the rows in order under the
row timeout and an optional deadline, then prints and writes the report."""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
MIN_ROW_S = 25.0  # a row given less than this before the deadline is skipped


# ---- the child: one row ----
def run_child(row: str, setup: dict[str, Any], result: Path, rows: Mapping[str, Callable]) -> int:
    """Run row `row` (`rows[row]`) and write its result, or its error, as JSON."""
    if setup["cpu"]:
        torch.set_num_threads(1)
    if setup.get("switch_interval"):  # the GIL's forced hand-off interval, for the whole row (issue 30)
        sys.setswitchinterval(setup["switch_interval"])
    try:
        out = rows[row](setup)
    except Exception as e:  # the row's error is its result; the other rows go on
        traceback.print_exc()
        out = {"error": f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"}
    out["host_peak"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    result.write_text(json.dumps(out))
    return 0


# ---- the parent: run the rows, report ----
def run_row(row: str, setup: dict[str, Any], timeout: float, script: str) -> dict[str, Any]:
    """Row `row` in a child process of `script` (its --child/--setup/--result arguments): its result, or why not."""
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result.json"
        cmd = [sys.executable, script, "--child", row, "--setup", json.dumps(setup), "--result", str(result)]
        env = dict(os.environ)  # the children import this checkout's xsched, as the parent does
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {timeout:.0f} s"}
        if result.exists():
            out = json.loads(result.read_text())
            if "error" in out:
                log(f"{row} failed:\n{p.stderr[-3000:]}")
            return out
        tail = (p.stderr.strip().splitlines() or ["no output"])[-1]
        return {"error": f"exit status {p.returncode}: {tail}"}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def run_rows(
    rows: list[str], setup: dict[str, Any], timeout: float, script: str, before: Callable | None = None
) -> dict[str, dict[str, Any]]:
    """Each row in a child process of `script`, in order, sharing one temporary cache directory; `before(row, setup,
    results)` may prepare `setup` for a row or return why it cannot run (its result, `{"skipped": why}`). With
    setup["deadline"] (a time.time()), each row's limit ends by then, less what is reserved for later rows
    (`row_limit`), and a row with under MIN_ROW_S left is skipped; with setup["json_out"], every result so far is
    written there after each row."""
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as cache:
        setup["cache_dir"] = cache
        for k, row in enumerate(rows):
            limit = row_limit(setup, rows[k + 1 :], timeout, time.time())
            if limit < MIN_ROW_S:
                results[row] = {"skipped": f"skipped: {max(limit, 0):.0f} s left before --deadline"}
            elif before is not None and (why := before(row, setup, results)) is not None:
                results[row] = {"skipped": why}
            else:
                log(f"{row}: running (limit {limit:.0f} s)")
                results[row] = run_row(row, setup, limit, script)
                log(f"{row}: {'done' if 'losses' in results[row] else results[row]}")
            if setup.get("json_out"):
                Path(setup["json_out"]).write_text(json.dumps({"setup": setup, "rows": results}, indent=1) + "\n")
    return results


def row_limit(setup: dict[str, Any], later: list[str], timeout: float, at: float) -> float:
    """A row's seconds: `timeout`, and under setup["deadline"] what is left of it less the seconds reserved
    (setup["reserve_s"]) for the rows still to run after it, so a late row is not starved by earlier overruns."""
    if setup.get("deadline") is None:
        return timeout
    reserved = sum(setup.get("reserve_s", {}).get(r, 0.0) for r in later)
    return min(timeout, setup["deadline"] - at - reserved)


def publish(
    title: str,
    where: str,
    script: str,
    argv: list[str] | None,
    a: argparse.Namespace,
    t0: float,
    results: dict[str, dict[str, Any]],
    table_lines: list[str],
) -> int:
    """Print the report (its command, device, torch, Python and time, then the table), write it to `a.out` if
    given; exit status 1 if a row failed."""
    device = "CPU (reduced mode)" if a.cpu else torch.cuda.get_device_name(0)
    cmd = " ".join([f"python scripts/{Path(script).name}", *(sys.argv[1:] if argv is None else argv)])
    lines = [
        f"# {title}",
        "",
        f"Command: `{cmd}`  ",
        f"Device: {device}; {where}; torch {torch.__version__}, Python {platform.python_version()}; "
        f"{time.perf_counter() - t0:.0f} s in all",
        "",
        *table_lines,
    ]
    text = "\n".join(lines) + "\n"
    print(text, flush=True)
    if a.out:
        Path(a.out).write_text(text)
    return 0 if all("error" not in r for r in results.values()) else 1
