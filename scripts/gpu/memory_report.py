"""The GPU memory benchmark's table and notes (scripts/bench_gpu_memory.py measures, this renders)."""

from __future__ import annotations

import textwrap
from html import escape as html_escape
from pathlib import Path

from xsched.errors import XschedError

COLUMNS = (
    "plan",
    "step time",
    "vs eager",
    "step peak",
    "vs eager peak",
    "step reserved",
    "predicted / measured time",
    "predicted / measured peak",
    "copies",
    "recomputes",
    "copy time hidden (measured / predicted)",
    "loss - eager loss",
    "grads vs eager",
)

NOTES = """\
Step: forward, then {step}, params' .grad set to None first (what the captured graph computes). `step time`: median of {iters} steps after {warmup}
untimed rounds, the device synchronised around each; xsched rows run the plan through the executor {mode}.
`vs eager`: against the eager PyTorch steps interleaved with the row's own (xsched rows) or with the other torch
rows (torch rows); the eager row pools every eager step of the run. `step peak`: {peak_source}, above what is
resident before the step (params, inputs, the ones). `step reserved`: CUDA max_memory_reserved less
memory_reserved before the step, the cache emptied first (what the caching allocator took from the GPU: the step
peak and its fragmentation; - on the CPU); for xsched rows, beside it, the reserved memory predicted by replaying
the plan on a model of the caching allocator (xsched.allocator, as `xsched plan --explain` says it)
over the measured: a range, where they differ, from the GPU keeping up with the host to the host a step ahead.
Rows `..., expandable segments`: the plan above run by Executor(expandable_segments=True), PyTorch's
expandable_segments:True on for that run only, its reserved memory beside the model's prediction with them.
Rows `..., planned addresses`: the plan run by Executor(planned_addresses=True), the step's values at planned offsets
in one arena allocated before the run (its bytes and segment added to the step's peak and reserved growth), beside
the model's prediction with the arena.
torch.compile rows: `--compile-backend`, plain and with `torch._functorch.config.activation_memory_budget` = the
xsched budget as a fraction (of the activations, not of the eager peak), each timed interleaved with eager PyTorch.
Budgets: % of the simulated eager peak ({eager_peak}, of which {resident} resident); `at checkpoint's peak`:
resident + the step peak measured for torch.utils.checkpoint.
`predicted`: the simulator on the one profile: the lanes model's makespan, and the compute device's peak less its
resident inputs. `copy time hidden` = (the same plan with every step in plan order on the calling thread, copies on
the compute stream, less the step on the lanes) / the plan's copy time predicted by the profile; {hidden}. Beside
it, the lanes model's own share: 1 - (makespan - makespan with free copies) / copy time. `loss - eager loss`: the
last step's loss against eager PyTorch's, every step seeded alike (the executor replays dropout draws). `grads vs
eager`: one more seeded step of the plan after the timed ones, the largest relative error (norm-wise) of a
parameter's gradient against eager PyTorch's (xsched rows; their twins run the same plan)."""

MODES = {
    True: "on its lanes (a thread per stream, copies on side streams)",
    False: "in plan order on the calling thread, as it runs plans on logical CPUs",
}
PEAKS = {
    "cuda": "CUDA max_memory_allocated",
    "cpu": "the CPU allocator's events of one step (torch rows), live storages counted on cpu:0 (xsched rows, "
    "xsched.execute.live_bytes)",
}
HIDDEN = {  # (device kind, measured on the lanes?)
    ("cuda", True): "the plan-order run also waits for the GPU after each copy to the host, as the executor does there",
    ("cpu", True): "on logical CPUs the lanes are threads sharing the cores",
    ("cuda", False): "n/a: the rows ran in plan order (both times are in the JSON)",
    ("cpu", False): "n/a on logical CPUs, where the lanes are threads sharing the cores (both times are in the JSON)",
}


def mib(b: float | None) -> str:
    return "-" if b is None else f"{b / 2**20:,.1f} MiB"


def ratio(a: float | None, b: float | None, pct: bool = False) -> str:
    if a is None or not b:
        return "-"
    return f"{a / b:.0%}" if pct else f"{a / b:.2f}x"


def predicted_reserved(row: dict) -> str:
    """' (predicted 0.75x)' or, where the GPU keeping up and the host a step ahead differ, ' (predicted 0.75-1.04x)'."""
    got, low = row.get("reserved"), row.get("predicted_reserved")
    if not got or low is None:
        return ""
    high = row.get("predicted_reserved_ahead", low)
    a, b = ratio(low, got), ratio(high, got)
    return f" (predicted {a if a == b else a[:-1] + '-' + b})"


def cells(row: dict, eager: dict) -> list[str]:
    """One table row; a row that did not run says why in its second cell."""
    if "error" in row:
        return [row["plan"], row["error"], *[""] * (len(COLUMNS) - 2)]
    hidden = "-"
    if row.get("copies"):
        measured = "n/a" if row.get("hidden") is None else f"{row['hidden']:.0%}"
        predicted = "-" if row["hidden_predicted"] is None else f"{row['hidden_predicted']:.0%}"
        hidden = f"{measured} / {predicted} of {row['copy_s'] * 1e3:.1f} ms"
    loss = "-" if row["loss"] is None or eager["loss"] is None else f"{abs(row['loss'] - eager['loss']):.1e}"
    return [
        row["plan"],
        f"{row['time_s'] * 1e3:.1f} ms",
        ratio(row["time_s"], row.get("eager_s", eager["time_s"])),
        mib(row["peak"]),
        ratio(row["peak"], eager["peak"], pct=True),
        mib(row.get("reserved")) + predicted_reserved(row),
        ratio(row.get("predicted_s"), row["time_s"]),
        ratio(row.get("predicted_peak"), row["peak"]),
        str(row.get("copies", "-")),
        str(row.get("recomputes", "-")),
        hidden,
        loss,
        "-" if row.get("grad_err") is None else f"{row['grad_err']:.1e}",
    ]


def render(title: str, header: list[str], rows: list[dict], notes: dict) -> str:
    """The markdown: title, header lines, the table (eager PyTorch is the first row), the notes filled in."""
    eager = rows[0]
    lines = [f"# {title}", "", *header, "", "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(cells(r, eager)) + " |" for r in rows]
    kind = "cuda" if notes["cuda"] else "cpu"
    text = NOTES.format(
        mode=MODES[notes["lanes"]],
        peak_source=PEAKS[kind],
        hidden=HIDDEN[(kind, notes["lanes"])],
        **{k: v for k, v in notes.items() if k not in ("cuda", "lanes")},
    )
    return "\n".join([*lines, "", textwrap.fill(" ".join(text.split()), 118)])


def frontier_plot(rows: list[dict], path: Path, title: str) -> Path:
    """Step time against measured step peak for every row that ran, as SVG: the figure `xsched report --measured`
    shows, or without matplotlib (the GPU image lacks it) a plain one drawn here."""
    try:
        from xsched.report.plots import frontier_figure

        path.write_text(frontier_figure(rows, title))
    except XschedError:  # matplotlib is not installed
        path.write_text(plain_svg(rows, title))
    return path


def plain_svg(rows: list[dict], title: str, w: int = 720, h: int = 460) -> str:
    """A scatter of step time (ms) against step peak (MiB) as hand-written SVG, one labelled mark per row."""
    from xsched.report.plots import family

    ok = [r for r in rows if "error" not in r and r.get("time_s") and r.get("peak") is not None]
    xs, ys = [r["peak"] / 2**20 for r in ok], [r["time_s"] * 1e3 for r in ok]
    x1, y1 = max(xs, default=1.0) * 1.1, max(ys, default=1.0) * 1.1
    left, bottom = 60, 40

    def px(x: float, y: float) -> tuple[float, float]:
        return left + x / x1 * (w - left - 20), h - bottom - y / y1 * (h - bottom - 30)

    color = {"torch": "#1f77b4", "torch.compile": "#ff7f0e", "xsched": "#2ca02c"}
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="9">']
    out.append(f'<text x="{w / 2}" y="16" text-anchor="middle" font-size="11">{html_escape(title)}</text>')
    out.append(f'<line x1="{left}" y1="{h - bottom}" x2="{w - 20}" y2="{h - bottom}" stroke="black"/>')
    out.append(f'<line x1="{left}" y1="{h - bottom}" x2="{left}" y2="30" stroke="black"/>')
    for k in range(1, 5):
        gx, gy = px(x1 * k / 5, 0)[0], px(0, y1 * k / 5)[1]
        out.append(f'<text x="{gx}" y="{h - bottom + 14}" text-anchor="middle">{x1 * k / 5:,.0f}</text>')
        out.append(f'<text x="{left - 4}" y="{gy + 3}" text-anchor="end">{y1 * k / 5:.0f}</text>')
    out.append(f'<text x="{w / 2}" y="{h - 6}" text-anchor="middle">measured step peak (MiB)</text>')
    out.append(
        f'<text x="14" y="{h / 2}" transform="rotate(-90 14 {h / 2})" text-anchor="middle">step time (ms)</text>'
    )
    for r, x, y in zip(ok, xs, ys):
        cx, cy = px(x, y)
        out.append(f'<circle cx="{cx:.1f}" cy="{cy:.1f}" r="4" fill="{color[family(r["plan"])]}"/>')
        out.append(f'<text x="{cx + 5:.1f}" y="{cy - 4:.1f}">{html_escape(r["plan"])}</text>')
    return "\n".join([*out, "</svg>"])
