"""How rank 0 shows a training run: a header and a tqdm bar (step time, loss, peak memory per device, energy, each
labelled with its source), or one JSON object per line (`--json`: start, step, checkpoint, end)."""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TextIO

from xsched.budgets import format_bytes
from xsched.pipeline import plan_report
from xsched.train.loop import StepRecord, TrainResult


def _energy(records: tuple[StepRecord, ...]) -> float | None:
    values = [r.energy_j for r in records]
    return None if not values or any(v is None for v in values) else float(sum(values))  # type: ignore[arg-type]


def _plan_source(info: Mapping[str, Any]) -> str:
    return f"plan {'reused from' if info['plan_reused'] else 'made and cached in'} {info['plan_path']}"


class Bar:
    """The header, then a tqdm bar on stderr; notices and checkpoints are written above the bar."""

    def __init__(self, out: TextIO | None = None) -> None:
        self.out = out or sys.stdout
        self.bar: Any = None
        self.energy = 0.0

    def start(self, info: Mapping[str, Any]) -> None:
        from tqdm import tqdm

        resumed = f", resumed at step {info['start_step']}" if info["resumed_from"] else ""
        procs = f"{info['world']} process{'es' if info['world'] > 1 else ''}"
        print(f"xsched train {info['model']}: {procs}, devices {', '.join(info['devices'])}{resumed}", file=self.out)
        print(f"  {_plan_source(info)}", file=self.out)
        print("  " + plan_report(info["graph"], info["plan"]).replace("\n", "\n  "), file=self.out, flush=True)
        self.bar = tqdm(total=info["steps"], initial=info["start_step"], desc="train", unit="step", dynamic_ncols=True)

    def step(self, r: StepRecord) -> None:
        if r.energy_j is not None:
            self.energy += r.energy_j
        peaks = " ".join(f"{d} {format_bytes(b)} ({r.peak_source[d]})" for d, b in r.peak_bytes.items())
        energy = "" if r.energy_j is None else f" | {self.energy:.3g} J {r.energy_source.split(' ')[0]}"
        self.bar.set_postfix_str(f"loss {r.loss:.4f} | {r.step_s * 1e3:.1f} ms/step | {peaks}{energy}", refresh=False)
        self.bar.update(1)

    def checkpoint(self, step: int, path: Path) -> None:
        self.notice(f"checkpoint after {step} steps: {path}")

    def notice(self, text: str) -> None:
        line = f"xsched train: {text}"
        if self.bar is not None:
            self.bar.write(line, file=sys.stderr)
        else:
            print(line, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()

    def end(self, result: TrainResult) -> None:
        self.close()
        records = result.records
        if not records:
            print(f"nothing to train: the run is already at step {result.start_step}", file=self.out)
            return
        energy = _energy(records)
        spent = "" if energy is None else f", {energy:.4g} J {records[-1].energy_source}"
        print(
            f"trained steps {result.start_step}..{records[-1].step} in {result.time_s:.2f} s (setup "
            f"{result.setup_s:.2f} s): final loss {records[-1].loss:.6g}{spent}",
            file=self.out,
        )
        if result.checkpoint is not None:
            print(f"checkpoint: {result.checkpoint}", file=self.out)


class JsonLines:
    """One JSON object per line on stdout, flushed as it happens; notices stay one line each on stderr."""

    def __init__(self, out: TextIO | None = None) -> None:
        self.out = out or sys.stdout

    def emit(self, event: str, **fields: Any) -> None:
        print(json.dumps({"event": event, **fields}), file=self.out, flush=True)

    def start(self, info: Mapping[str, Any]) -> None:
        plan = info["plan"]
        p, s = plan.predicted, plan.solver
        self.emit(
            "start",
            model=info["model"],
            world=info["world"],
            devices=list(info["devices"]),
            budgets=dict(info["budgets"]),
            start_step=info["start_step"],
            steps=info["steps"],
            resumed_from=info["resumed_from"],
            plan_path=info["plan_path"],
            plan_reused=info["plan_reused"],
            profile_path=info["profile_path"],
            method=s.method,
            status=s.status,
            energy_source=info["energy_source"],
            predicted={"time_s": p.time_s, "peak_bytes": dict(p.peak_bytes), "energy_j": p.energy_j} if p else None,
        )

    def step(self, r: StepRecord) -> None:
        self.emit(
            "step",
            step=r.step,
            loss=r.loss,
            step_s=r.step_s,
            peak_bytes=dict(r.peak_bytes),
            peak_source=dict(r.peak_source),
            energy_j=r.energy_j,
            energy_source=r.energy_source,
        )

    def checkpoint(self, step: int, path: Path) -> None:
        self.emit("checkpoint", steps_done=step, path=str(path))

    def notice(self, text: str) -> None:
        print(f"xsched train: {text}", file=sys.stderr, flush=True)

    def close(self) -> None:
        self.out.flush()

    def end(self, result: TrainResult) -> None:
        records = result.records
        self.emit(
            "end",
            start_step=result.start_step,
            steps_run=len(records),
            world=result.world,
            time_s=result.time_s,
            setup_s=result.setup_s,
            final_loss=records[-1].loss if records else None,
            energy_j=_energy(records),
            energy_source=records[-1].energy_source if records else None,
            checkpoint=str(result.checkpoint) if result.checkpoint else None,
        )
