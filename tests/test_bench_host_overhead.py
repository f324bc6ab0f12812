"""scripts/bench_host_overhead.py at a tiny size (2 layers): every row runs, the table has each row's times per op
and ratios to eager, the xsched rows' losses equal eager's (inline and on lanes), the offload plan copies, and the
lanes rows (as is, and with a lowered GIL switch interval, their steps interleaved) have their compute lane's CPU,
wall and waiting per op, the copy lanes' CPU / wall, the compute lane's share of the tasks and its run-queue wait."""

from __future__ import annotations

import subprocess
import sys

from train_support import ROOT, child_env


def test_every_row_runs_and_matches_eager_losses() -> None:
    cmd = [sys.executable, str(ROOT / "scripts" / "bench_host_overhead.py"), "--layers", "2", "--steps", "3"]
    cmd += ["--warmup", "1", "--budget", "1MiB", "--switch-intervals", "0.0005"]
    p = subprocess.run(cmd, capture_output=True, text=True, env=child_env(), timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = [line.split(" | ") for line in p.stdout.splitlines() if line.startswith("| ") and " us | " in line]
    assert [r[0] for r in rows] == [
        "| eager PyTorch (forward, backward, AdamW)",
        "| xsched.wrap, eager plan on cpu",
        "| xsched train --param-home cpu:1 --store cpu:1, park on cpu:0, host AdamW",
        "| the same, its executor on lanes (a thread per stream, as on a GPU)",
        "| the same, its executor on lanes (a thread per stream, as on a GPU), GIL switch interval 0.5 ms",
    ]
    for r in rows:
        assert r[1] == "2"  # 3 steps less the warm-up
        assert all(r[k].endswith(" us") and r[k + 1].endswith("x") for k in (3, 6, 9, 12)), r
    assert rows[0][14] == "eager" and rows[0][3 + 1] == "1.00x"
    assert all(r[14].startswith("yes (max diff") for r in rows[1:]), rows
    copies = [int(r[15]) for r in rows]
    assert copies[:2] == [0, 0] and copies[2] > 0 and copies[3] == copies[4] == copies[2]  # one plan, which copies
    assert all(r[16:24] == ["-"] * 7 + ["- |"] for r in rows[:3]), rows  # the lanes' figures: lanes rows only
    for r in rows[3:]:
        assert all(r[k].endswith(" us") for k in (16, 17, 18)) and float(r[16][:-3]) > 0 and float(r[17][:-3]) > 0
        for k in (19, 20):  # the copy lanes' CPU / wall
            cpu, wall = r[k].removesuffix(" ms").split(" / ")
            assert float(wall) > 0 and float(cpu) >= 0, r
        mine, every = (int(x) for x in r[21].split(" / "))
        assert 0 < mine < every  # the compute lane runs some of the tasks, the copy and free lanes the rest
        switches, preempted = r[22].split(" ")
        assert float(switches) > 0 and 0 <= float(preempted.strip("()")) <= float(switches)  # it waits for weights
        assert r[23].endswith(" ms |")
    assert "ops a training step" in p.stdout
