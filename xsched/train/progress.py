"""How rank 0 shows a training run: a header and a tqdm bar (loss, validation loss, learning rate, gradient norm,
tokens/s, step time, peak memory per device, energy, each labelled with its source), or one JSON object per line
(`--json`: start, step, checkpoint, end); `--log-csv` writes the step lines' fields to a CSV file as well."""

from __future__ import annotations

import csv
import io
import json
import math
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TextIO

from xsched.budgets import format_bytes
from xsched.errors import XschedError
from xsched.files import atomic_write
from xsched.pipeline import plan_report
from xsched.train.records import Reporter, StepRecord, TrainResult, setup_text


def _energy(records: tuple[StepRecord, ...]) -> float | None:
    values = [r.energy_j for r in records]
    return None if not values or any(v is None for v in values) else float(sum(values))  # type: ignore[arg-type]


STEP_FIELDS = (
    "step",
    "loss",
    "val_loss",
    "lr",
    "grad_norm",
    "tokens_per_s",
    "step_s",
    "loss_scale",
    "peak_bytes",
    "peak_source",
    "energy_j",
    "energy_source",
)
PER_DEVICE = ("peak_bytes", "peak_source")  # {device: value}; the CSV log has a column per device


def step_fields(r: StepRecord) -> dict[str, Any]:
    """A step's fields as --json and --log-csv write them."""
    return {k: dict(getattr(r, k)) if k in PER_DEVICE else getattr(r, k) for k in STEP_FIELDS}


def _plan_source(info: Mapping[str, Any]) -> str:
    return f"plan {'reused from' if info['plan_reused'] else 'made and cached in'} {info['plan_path']}"


class Bar:
    """The header, then a tqdm bar on stderr; notices and checkpoints are written above the bar."""

    def __init__(self, out: TextIO | None = None) -> None:
        self.out = out or sys.stdout
        self.bar: Any = None
        self.energy = 0.0
        self.val = ""  # the last validation loss, shown until the next

    def start(self, info: Mapping[str, Any]) -> None:
        from tqdm import tqdm

        resumed = f", resumed at step {info['start_step']}" if info["resumed_from"] else ""
        procs = f"{info['world']} process{'es' if info['world'] > 1 else ''}"
        print(f"xsched train {info['model']}: {procs}, devices {', '.join(info['devices'])}{resumed}", file=self.out)
        sched = info["schedule"]
        print(
            f"  {info['precision']}, {info['grad_accum']} micro-batch(es) per step, learning rate {sched['name']} "
            f"from {sched['lr']:g} (warmup {sched['warmup']})",
            file=self.out,
        )
        if info.get("param_home"):
            how = "overlapped with the backward" if info.get("optimizer_overlap") else "after the backward"
            how += f" ({info['host_share']})" if info.get("host_share") else ""
            print(f"  parameters and optimizer state on {info['param_home']}, its step {how}", file=self.out)
        print(f"  {_plan_source(info)}", file=self.out)
        print("  " + plan_report(info["graph"], info["plan"]).replace("\n", "\n  "), file=self.out, flush=True)
        self.bar = tqdm(total=info["steps"], initial=info["start_step"], desc="train", unit="step", dynamic_ncols=True)

    def step(self, r: StepRecord) -> None:
        if r.energy_j is not None:
            self.energy += r.energy_j
        if r.val_loss is not None:
            self.val = f" val {r.val_loss:.4f} |"
        peaks = " ".join(f"{d} {format_bytes(b)} ({r.peak_source[d]})" for d, b in r.peak_bytes.items())
        energy = "" if r.energy_j is None else f" | {self.energy:.3g} J {r.energy_source.split(' ')[0]}"
        speed = f"{r.step_s * 1e3:.1f} ms/step" + ("" if r.tokens_per_s is None else f" {r.tokens_per_s:.4g} tok/s")
        self.bar.set_postfix_str(
            f"loss {r.loss:.4f} |{self.val} lr {r.lr:.3g} | norm {r.grad_norm:.3g} | {speed} | {peaks}{energy}",
            refresh=False,
        )
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
        val = "" if result.final_val_loss is None else f", validation loss {result.final_val_loss:.6g}"
        stages = setup_text(result.setup_stages)
        print(
            f"trained steps {result.start_step}..{records[-1].step} in {result.time_s:.2f} s (setup "
            f"{result.setup_s:.2f} s{': ' + stages if stages else ''}): final loss {records[-1].loss:.6g}{val}{spent}",
            file=self.out,
        )
        if result.optimizer is not None:
            o = result.optimizer
            share = f"{o.hidden_share:.0%}" if o.hidden_share is not None else "n/a"
            print(
                f"host optimizer: {o.optimizer_s:.3f} s, {share} of it during backward passes, {o.waited_s:.3f} s "
                "waited for",
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
            precision=info["precision"],
            grad_accum=info["grad_accum"],
            schedule=info["schedule"],
            param_home=info.get("param_home"),
            optimizer_overlap=info.get("optimizer_overlap", False),
            delayed_update=info.get("delayed_update", False),
            host_share=info.get("host_share"),
            master_weights=info.get("master_weights"),
            predicted={"time_s": p.time_s, "peak_bytes": dict(p.peak_bytes), "energy_j": p.energy_j} if p else None,
        )

    def step(self, r: StepRecord) -> None:
        fields = step_fields(r)  # strict JSON: an fp16 overflow's inf or nan norm is null (its loss scale drops)
        if r.breakdown is not None:  # where the step's time went (xsched.execute.step_clock)
            fields["breakdown"] = dict(r.breakdown)
        self.emit(
            "step", **{k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in fields.items()}
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
            setup_stages=dict(result.setup_stages),
            final_loss=records[-1].loss if records else None,
            final_val_loss=result.final_val_loss,
            energy_j=_energy(records),
            energy_source=records[-1].energy_source if records else None,
            checkpoint=str(result.checkpoint) if result.checkpoint else None,
            **_optimizer_fields(result),
        )


def _optimizer_fields(result: TrainResult) -> dict[str, Any]:
    o = result.optimizer
    if o is None:
        return {}
    return {"optimizer_s": o.optimizer_s, "optimizer_hidden_s": o.hidden_s, "optimizer_waited_s": o.waited_s}


class CsvLog:
    """`--log-csv PATH`: the step lines' fields, one row per step (peak bytes one column per device), written as
    they happen. A resumed run keeps the rows of the steps before it (so each step is in the file once); a new run
    starts the file afresh. Rows to keep under another header (other devices) are an error, before any step."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.file: TextIO | None = None
        self.writer: Any = None

    def start(self, info: Mapping[str, Any]) -> None:
        devices = info["plan"].devices
        header = [c for k in STEP_FIELDS for c in ([f"{k}:{d}" for d in devices] if k in PER_DEVICE else [k])]
        kept = self._earlier_rows(header, info["start_step"])
        text = io.StringIO()
        csv.writer(text).writerows([header, *kept])
        atomic_write(self.path, lambda f: f.write(text.getvalue().encode()))
        self.file = open(self.path, "a", newline="")  # open until the run ends: close()
        self.writer = csv.DictWriter(self.file, header, extrasaction="ignore")

    def _earlier_rows(self, header: list[str], start: int) -> list[list[str]]:
        if start == 0 or not self.path.exists():
            return []
        with open(self.path, newline="") as f:
            rows = list(csv.reader(f))
        kept = [r for r in rows[1:] if r and r[0].isdigit() and int(r[0]) < start]
        if kept and rows[0] != header:
            raise XschedError(
                f"--log-csv {self.path} has other columns ({','.join(rows[0])}); give another file", stage="train"
            )
        return kept

    def step(self, r: StepRecord) -> None:
        row: dict[str, Any] = {}
        for k, v in step_fields(r).items():
            row |= {f"{k}:{d}": x for d, x in v.items()} if k in PER_DEVICE else {k: v}
        self.writer.writerow({k: "" if v is None else v for k, v in row.items()})
        self.file.flush()  # type: ignore[union-attr]

    def checkpoint(self, step: int, path: Path) -> None: ...
    def notice(self, text: str) -> None: ...
    def end(self, result: TrainResult) -> None: ...

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None


class Tee:
    """Several reporters as one (the bar or JSON lines, and the CSV log); notices go to the first only."""

    def __init__(self, *reporters: Reporter) -> None:
        self.reporters = reporters

    def start(self, info: Mapping[str, Any]) -> None:
        for r in self.reporters:
            r.start(info)

    def step(self, record: StepRecord) -> None:
        for r in self.reporters:
            r.step(record)

    def checkpoint(self, step: int, path: Path) -> None:
        for r in self.reporters:
            r.checkpoint(step, path)

    def notice(self, text: str) -> None:
        self.reporters[0].notice(text)

    def end(self, result: TrainResult) -> None:
        for r in self.reporters:
            r.end(result)

    def close(self) -> None:
        for r in self.reporters:
            r.close()
