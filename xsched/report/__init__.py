"""What-if reports: time, memory and energy of a choice before making it, per device, from one profile.

`build_report(graph, profile, machines, out_dir)` (xsched.report.build) writes report.html and its numbers:
- budget sweep (sweep.py): the solver's plan and the eager, greedy (accelerate-style) and checkpoint baselines
  at many budgets of each device;
- device what-if (machines.py, whatif.py): one graph planned for several machines (`cpu+sim:a100-40gb`,
  `cpu+sim:l4#0+sim:l4#1`, `sim:rtx4090@60%mem+cpu`), measured costs where a device is real, the roofline
  model of its spec where it is simulated, each labelled;
- energy (energy.py): time against energy as the objective's energy weight grows, the fastest plan under caps;
- plan pictures (pictures.py): compute and keep matrices, memory over time against the budget, the lanes;
- Chrome traces (trace.py): predicted from the simulator, measured from a run (`xsched run --trace`).

Plots are drawn with matplotlib (the `report` extra: pip install xsched[report]) as inline SVG: the report is one
HTML file with no JavaScript that opens offline, in any browser, and diffs as text. Plotly or Bokeh would embed
megabytes of JavaScript in every file (or fetch it from a CDN, which fails offline). matplotlib is imported only
when drawing (draw.py); everything else here, and the rest of xsched, imports without it.
"""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:  # lazy: importing xsched.report.trace need not import the solvers
    if name in ("build_report", "ReportSettings", "Report"):
        from xsched.report import build

        return getattr(build, name)
    if name in ("Machine", "parse_machine"):
        from xsched.report import machines

        return getattr(machines, name)
    if name == "SweepSettings":
        from xsched.report.sweep import SweepSettings

        return SweepSettings
    raise AttributeError(f"module 'xsched.report' has no attribute {name!r}")
