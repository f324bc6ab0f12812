"""What-if reports: the page and its data files, the sweeps' and studies' invariants, the plan pictures' matrices,
and the page in a real browser (headless Chromium: no console errors, a screenshot)."""

from __future__ import annotations

import csv
import importlib.util
import json
import sys
from dataclasses import replace
from html.parser import HTMLParser
from pathlib import Path

import pytest
from conftest import chain_graph
from oracle import sequential_time

from xsched.contracts.plan import Compute
from xsched.errors import XschedError
from xsched.profiling.measure import extend_profile, profile_graph
from xsched.profiling.model import cost_profile
from xsched.report.build import SECTIONS, ReportSettings, build_report
from xsched.report.machines import base_budgets, parse_machine, restrict
from xsched.report.sweep import SweepSettings
from xsched.solve.api import solve

pytest.importorskip("matplotlib")

FIGURES = {
    "sweep": ["fig-sweep"],
    "whatif": ["fig-whatif"],
    "energy": ["fig-energy"],
    "pictures": ["fig-matrices", "fig-memory", "fig-timeline"],
}
MACHINES = ("sim:rtx4090+sim:xeon-8480", "sim:l4#0+sim:l4#1+sim:xeon-8480")
SETTINGS = ReportSettings(SweepSettings("auto", 0.2, 2), progress=False, alphas=(0.0, 30.0), caps=2)


def graph_and_profile():
    """A 6-layer training chain on simulated devices (a CPU spec as the host): quick and with modelled energy."""
    graph = chain_graph([4000, 16000, 16000, 8000, 8000, 2000], train=True)
    devices = ["sim:xeon-8480", "sim:rtx4090", "sim:l4#0", "sim:l4#1"]
    return graph, profile_graph(graph, devices, progress=False)


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    graph, profile = graph_and_profile()
    out = tmp_path_factory.mktemp("report")
    machines = [parse_machine(m) for m in MACHINES]
    return build_report(graph, profile, machines, out, SETTINGS, "xsched report (test)"), graph, profile


class _Page(HTMLParser):
    """Sections by id, with their figures (id -> has an <svg>), tables and data links; scripts and outside URLs."""

    def __init__(self) -> None:
        super().__init__()
        self.sections: dict[str, dict] = {}
        self.current: dict | None = None
        self.figure: str | None = None
        self.scripts = 0
        self.outside: list[str] = []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        for key in ("src", "href"):
            if a.get(key, "").startswith(("http:", "https:", "//")):
                self.outside.append(a[key])
        if tag == "script":
            self.scripts += 1
        if tag == "section":
            self.current = self.sections.setdefault(a["id"], {"figures": {}, "tables": 0, "links": []})
        elif self.current is None:
            return
        elif tag == "figure":
            self.figure = a["id"]
            self.current["figures"][self.figure] = False
        elif tag == "svg" and self.figure:
            self.current["figures"][self.figure] = True
        elif tag == "table":
            self.current["tables"] += 1
        elif tag == "a":
            self.current["links"].append(a["href"])

    def handle_endtag(self, tag):
        if tag == "figure":
            self.figure = None
        elif tag == "section":
            self.current = None


def test_report_has_each_section_figure_table_and_data_file(report):
    r, graph, _ = report
    page = _Page()
    page.feed(r.html.read_text())
    assert list(page.sections) == list(SECTIONS)
    assert page.scripts == 0 and page.outside == []  # self-contained: nothing to run, nothing fetched
    for name, figs in FIGURES.items():
        sec = page.sections[name]
        assert sec["figures"] == dict.fromkeys(figs, True), name
        assert sec["links"], name
        for link in sec["links"]:
            assert (r.html.parent / link).is_file(), link
    for stem in ("sweep", "whatif", "energy"):
        assert page.sections[stem]["tables"] >= 1
        rows = list(csv.DictReader((r.html.parent / f"{stem}.csv").open()))
        raw = json.loads((r.html.parent / f"{stem}.json").read_text())
        points = [p for s in raw for p in s.get("points", [])]
        if stem == "whatif":
            points = [p for m in raw for p in (*m["points"], *m["sweep"]["points"])]
        assert len(rows) == len(points) > 0, stem
    trace = json.loads((r.html.parent / "predicted-trace.json").read_text())
    plan = json.loads((r.html.parent / "plan.json").read_text())
    assert sum(e["ph"] == "X" for e in trace["traceEvents"]) == len(plan["steps"])
    summary = json.loads((r.html.parent / "report.json").read_text())
    assert summary["graph"]["fingerprint"] == graph.fingerprint
    assert [m["machine"] for m in summary["machines"]] == [parse_machine(m).label for m in MACHINES]
    svg = r.html.read_text()
    assert all(f">{m}<" in svg for m in ("auto", "eager", "greedy", "checkpoint"))  # legend text kept as text
    assert (
        "reserved ~" in svg and "over the plan" in svg
    )  # the pictured plan's expected fragmentation (xsched.allocator)
    assert "with expandable segments ~" in svg and "with planned addresses (--planned-addresses) the same: " in svg
    sweep = {
        tuple(p["reserved_bytes"]) for s in json.loads((r.html.parent / "sweep.json").read_text()) for p in s["points"]
    }
    accelerators = set().union(*sweep)
    assert accelerators
    for d in accelerators:  # each accelerator's columns: expandable segments, planned addresses
        assert f"reserved {d}, expandable segments<" in svg and f"reserved {d}, planned addresses<" in svg


def test_sweep_points_are_checked_plans_and_auto_beats_baselines(report):
    r, graph, profile = report
    raw = json.loads((r.html.parent / "sweep.json").read_text())
    machine = parse_machine(MACHINES[0])
    for s in raw:
        assert s["lower_bound"] <= min(p["budget_bytes"] for p in s["points"])
        by = {}
        for p in s["points"]:
            by.setdefault(p["budget_bytes"], {})[p["method"]] = p
            if p["time_s"] is not None:
                for d in s["swept"]:
                    assert p["peak_bytes"][d] <= p["budget_bytes"]
            else:
                assert p["status"] in ("infeasible", "no plan") and p["note"]
        for methods in by.values():
            auto = methods["auto"]
            for m in ("eager", "greedy", "checkpoint"):
                if methods[m]["time_s"] is not None:  # auto runs every heuristic first: never slower (its makespan)
                    assert auto["makespan_s"] is not None
                    assert auto["makespan_s"] <= methods[m]["makespan_s"] * (1 + 1e-9)
    # the numbers are the plans' own: re-solve one point and count its time step by step (tests/oracle.py)
    p = next(p for p in raw[1]["points"] if p["method"] == "checkpoint" and p["time_s"] is not None)
    sub = restrict(profile, machine.devices)
    plan = solve(graph, sub, p["budgets"], machine.devices, "checkpoint")
    assert sequential_time(graph, plan, sub) == pytest.approx(p["time_s"])


def test_energy_caps_hold_and_sources_are_labelled(report):
    r, _, profile = report
    studies = json.loads((r.html.parent / "energy.json").read_text())
    assert [x["machine"] for x in studies] == [parse_machine(m).label for m in MACHINES]
    for x in studies:
        assert x["source"] == "energy modelled"  # roofline specs: nothing measured
        caps = [p for p in x["points"] if p["kind"] == "cap"]
        assert caps and any(p["time_s"] is not None for p in caps)
        for p in caps:
            if p["time_s"] is not None:
                assert p["energy_j"] <= p["cap_j"] * (1 + 1e-9)
        alphas = [p for p in x["points"] if p["kind"] == "alpha"]
        assert alphas[0]["alpha"] == 0 and len({p["alpha"] for p in alphas}) == len(alphas) > 1
    whatif = json.loads((r.html.parent / "whatif.json").read_text())
    assert "roofline model of spec l4" in whatif[1]["sources"]["sim:l4#1"]


def test_matrices_mark_first_computes_recomputes_and_residency():
    from xsched.report.pictures import matrices, walk

    graph, profile = graph_and_profile()
    sub = restrict(profile, ["sim:xeon-8480"])
    plan = solve(graph, sub, {"sim:xeon-8480": "80%"}, ["sim:xeon-8480"], "checkpoint")
    w = walk(graph, plan, sub)
    comp, keep = matrices(graph, plan, w)["sim:xeon-8480"]
    computes = [s for s in plan.steps if isinstance(s, Compute)]
    assert int((comp > 0).sum()) == len(computes) and int((comp == 2).sum()) == len(computes) - len(graph.ops) > 0
    rows = {o.id: k for k, o in enumerate(graph.ops)}
    for t, op in enumerate(w.order):
        assert comp[t, rows[op]] == 1  # stage t ends with op t's first compute
    produced = [v for o in graph.ops for v in o.outputs]
    for t, kept in enumerate(w.kept):
        assert {produced[j] for j in keep[t].nonzero()[0]} == set(kept["sim:xeon-8480"]) & set(produced)


def test_base_budgets_and_machine_syntax():
    graph, profile = graph_and_profile()
    m = parse_machine("sim:rtx4090@60%mem + sim:xeon-8480@50%")
    assert m.devices == ("sim:rtx4090", "sim:xeon-8480") and m.label == "sim:rtx4090@60%mem + sim:xeon-8480@50%"
    b = base_budgets(m, restrict(profile, m.devices), 1000)
    assert b == {"sim:rtx4090": int(0.6 * 24 * 2**30), "sim:xeon-8480": 500}
    modelled = cost_profile(graph, ["cpu"])
    assert base_budgets(parse_machine("cpu"), modelled, 1000) == {}  # unknown memory size: no budget
    with pytest.raises(XschedError, match="memory size"):
        base_budgets(parse_machine("cpu@50%mem"), modelled, 1000)
    for bad in ("cpu+", "cpu@", "cpu+cpu"):
        with pytest.raises(XschedError):
            parse_machine(bad)


def test_extend_profile_adds_devices_and_links_keeping_the_rest():
    graph = chain_graph([100, 200], train=True)
    base = cost_profile(graph, ["cpu"])
    ext = extend_profile(graph, base, ["cpu", "sim:t4"], progress=False)
    alone = profile_graph(graph, ["sim:t4"], progress=False)
    assert ext.compute["cpu"] == base.compute["cpu"] and ext.compute["sim:t4"] == alone.compute["sim:t4"]
    assert {"cpu->sim:t4", "sim:t4->cpu"} <= set(ext.copy) and ext.energy_source["sim:t4"] == "model"
    assert ext.profiling["extended"] == ["sim:t4"]
    assert extend_profile(graph, ext, ["sim:t4"]) is ext


def test_missing_matplotlib_is_one_clear_error(tmp_path, monkeypatch):
    graph, profile = graph_and_profile()
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(XschedError, match=r"pip install xsched\[report\]"):
        build_report(graph, profile, [parse_machine("cpu")], tmp_path, SETTINGS)
    assert not any(tmp_path.iterdir())  # failed before solving or writing anything


def _render():
    path = Path(__file__).resolve().parents[1] / "scripts" / "render_html.py"
    spec = importlib.util.spec_from_file_location("render_html", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("render_html", mod)  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def test_report_opens_in_a_browser_without_errors(report, tmp_path):
    render = _render()
    if render.find_browser() is None:
        pytest.skip("no chromium or chrome on PATH")
    r, _, _ = report
    shot = tmp_path / "report.png"
    out = render.render(r.html, shot)
    assert out.errors == []
    assert out.height > 2000  # every section laid out
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 50_000
    bad = tmp_path / "bad.html"  # and the check can fail: a page that throws and misses a file
    bad.write_text('<html><body><img src="missing.png"><script>throw new Error("boom")</script></body></html>')
    errors = render.render(bad).errors
    assert any("boom" in e for e in errors) and any("missing.png" in e for e in errors)


def test_tables_show_the_makespan_and_label_the_sequential_time():
    """The issue's report plotted `auto` at 248 ms sequential against checkpoint's 164 ms, though auto's makespan (what
    the executor runs) was 152 ms: every method's column is its makespan, the sequential time is labelled as such."""
    from xsched.report.data import machine_cells, sweep_cells
    from xsched.report.sweep import Point

    auto = Point("m", "gpu", 100, "auto", "optimal", time_s=0.248, makespan_s=0.152, energy_j=1.0)
    ckpt = Point("m", "gpu", 100, "checkpoint", "heuristic", time_s=0.164, makespan_s=0.164, energy_j=1.0)
    (row,) = sweep_cells([auto, ckpt], ["auto", "checkpoint"], [])
    assert row[1:5] == ("152 ms", "164 ms", "optimal", "248 ms")  # budget, makespans, auto's status, sequential
    assert auto.step_s == 0.152 and Point("m", "gpu", 1, "x", "ok", time_s=2.0).step_s == 2.0  # untimed lanes

    class Result:
        machine = parse_machine("cpu")
        points = (auto, ckpt)
        budgets: dict = {}

    (row,) = machine_cells([Result()], ["auto", "checkpoint"])
    assert row[1:5] == ("152 ms", "164 ms", "optimal", "248 ms")
    gpu = Point(
        "m", "gpu", 1, "auto", "optimal", 1.0, peak_bytes={"gpu": 5 << 20}, reserved_bytes={"gpu": (22 << 20,) * 2}
    )
    (row,) = sweep_cells([gpu], ["auto"], ["gpu", "cpu"])
    assert row[-2:] == ("5 MiB (reserved ~22 MiB)", "0 B")  # the reserved memory beside an accelerator's peak
    gpu = replace(gpu, reserved_bytes={"gpu": (22 << 20, 30 << 20)})  # from the GPU keeping up to the host ahead
    assert sweep_cells([gpu], ["auto"], ["gpu"])[0][-1] == "5 MiB (reserved ~22 MiB-30 MiB)"


def test_the_measuredfrontier_section(tmp_path):
    """`xsched report --measured` shows a memory benchmark's rows: a marker per row that ran, a table of all."""
    from xsched.report.sections import frontier_section

    rows = [
        {"plan": "eager PyTorch", "time_s": 0.129, "peak": 14 << 30, "reserved": 15 << 30},
        {"plan": "torch.compile, activation_memory_budget 0.5", "time_s": 0.15, "peak": 7 << 30},
        {"plan": "torchtune OffloadActivations", "error": "skipped: torchtune does not import"},
        {"plan": "xsched 45%, cpu store", "time_s": 0.16, "peak": 5 << 30, "reserved": 6 << 30},
    ]
    measured = tmp_path / "gpu_memory.json"
    measured.write_text(json.dumps({"facts": {"device": "H100", "graph": "g"}, "rows": rows}))
    (tmp_path / "out").mkdir()
    sec = frontier_section(measured, tmp_path / "out", {})
    (fig,) = sec.figures
    assert "eager PyTorch" in fig.svg and "xsched 45%, cpu store" in fig.svg and "torchtune" not in fig.svg
    assert [r[0] for r in sec.tables[0].rows] == [r["plan"] for r in rows]
    assert (tmp_path / "out" / "gpu_memory.json").is_file()
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2]")
    with pytest.raises(XschedError, match="not a bench_gpu_memory JSON"):
        frontier_section(bad, tmp_path / "out", {})
