"""docs/ARCHITECTURE.md stays true: its example contracts load and count as its hand count says, its example solver
registers with its registration line and runs, its layer table is tests/test_imports.py's LAYERS, and it, the README
and the module docstrings name no file outside the repository."""

from __future__ import annotations

import ast
import json
import re
from dataclasses import replace
from pathlib import Path

import pytest
from test_imports import LAYERS

from xsched.contracts.graph import Graph
from xsched.contracts.plan import Compute, Free, Plan, place_frees
from xsched.contracts.profile import Profile
from xsched.errors import PlanError
from xsched.simulate import simulate
from xsched.solve import SOLVERS, SolverEntry, SolverOptions, solve

ROOT = Path(__file__).resolve().parents[1]
DOC = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
REGISTERED = list(SOLVERS)  # at collection, before any test changes the registry


def blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", DOC, flags=re.S)


def example() -> tuple[Graph, Profile, Plan]:
    graph, profile, plan = (json.loads(b) for b in blocks("json"))
    return Graph.from_dict(graph), Profile.from_dict(profile), Plan.from_dict(plan)


def section(title: str) -> str:
    """The text of the doc's section `title`, up to the next heading of its level or higher."""
    head = re.search(rf"^(#+) {re.escape(title)}\n", DOC, flags=re.M)
    assert head, f"no section {title!r}"
    rest = DOC[head.end() :]
    end = re.search(rf"^#{{1,{len(head.group(1))}}} ", rest, flags=re.M)
    return rest[: end.start()] if end else rest


def test_the_example_counts_as_the_hand_count_says() -> None:
    g, p, plan = example()
    assert p.graph == plan.graph == g.fingerprint
    r = simulate(g, plan, p)
    assert dict(r.peak_bytes) == {"cpu": 300, "cuda:0": 550} and dict(r.peak_step) == {"cpu": 0, "cuda:0": 4}
    assert r.time_s == pytest.approx(0.0075) and r.makespan_s == pytest.approx(0.0065)
    assert r.energy_j == pytest.approx(0.13)
    ms = [(round(a * 1e3, 6), round(b * 1e3, 6)) for a, b in r.step_span]
    assert ms == [(0, 1), (1, 3.5), (3.5, 3.5), (3.5, 4.5), (3.5, 5.5), (5.5, 6.5), (6.5, 6.5), (6.5, 6.5)]
    assert [a["cpu"] for a in r.resident_after] == [300, 300, 100, 110, 110, 110, 110, 110]
    assert [a["cuda:0"] for a in r.resident_after] == [0, 200, 200, 200, 500, 510, 310, 10]
    hand = section("The example, counted by hand")
    assert "Peaks: CPU 300 B (step 0), GPU 550 B (step 4)" in hand and "= 7.5 ms; makespan 6.5 ms" in hand
    assert "= 0.13 J" in hand
    with pytest.raises(PlanError, match="memory 550 B exceeds the budget of 512 B") as e:
        simulate(g, replace(plan, budgets={"cuda:0": 512}), p)
    assert "step=4" in str(e.value) and "(`memory 550 B exceeds the budget of 512 B`)" in DOC


def test_the_example_plan_frees_as_place_frees_does() -> None:
    g, _, plan = example()
    body = [s for s in plan.steps if not isinstance(s, Free)]
    assert place_frees(g, body, plan.homes) == plan.steps


def example_solver() -> SolverEntry:
    """The doc's solver module, registered by the doc's registration line (`lazy` resolving to that module)."""
    module = next(b for b in blocks("python") if "first_fit.py" in b)
    line = next(b for b in blocks("python") if b.startswith("register("))
    ns: dict = {}
    exec(compile(module, "first_fit.py", "exec"), ns)
    entries: list[SolverEntry] = []
    exec(
        line, {"register": entries.append, "SolverEntry": SolverEntry, "lazy": lambda target: ns[target.split(":")[1]]}
    )
    assert len(entries) == 1
    return entries[0]


@pytest.fixture
def registry():
    """SOLVERS to change, restored afterwards in its registration order (monkeypatch.delitem's undo re-inserts
    deleted entries in reverse order, which would change what auto runs first in later tests)."""
    saved = dict(SOLVERS)
    yield SOLVERS
    SOLVERS.clear()
    SOLVERS.update(saved)


def test_the_example_solver_is_a_method(registry) -> None:
    entry = example_solver()
    assert (entry.name, entry.kind, entry.max_size, entry.share) == ("first-fit", "search", 5000, 0.1)
    registry[entry.name] = entry
    g, p, _ = example()
    plan = solve(g, p, {"cuda:0": 600}, devices=["cuda:0", "cpu"], method="first-fit", homes={"x": "cpu"})
    assert plan.solver.method == plan.solver.found_by == "first-fit"
    assert plan.first_computes() == ("op0", "op1", "op2", "op3")
    assert [s.device for s in plan.steps if isinstance(s, Compute)] == ["cpu", "cuda:0", "cuda:0", "cpu"]
    assert plan.predicted.time_s == pytest.approx(0.0075) and plan.predicted.peak_bytes["cuda:0"] == 550
    low = solve(g, p, {"cuda:0": 500}, devices=["cuda:0", "cpu"], method="first-fit", homes={"x": "cpu"})
    assert low.solver.status == "heuristic" and low.solver.stats.fallback_reason == "peaks at 550 B on cuda:0"


def test_auto_runs_the_example_solver_with_a_warm_start(registry) -> None:
    entry = example_solver()
    warm_starts = []

    def spy(problem, options, warm):
        warm_starts.append(warm)
        return entry.fn(problem, options, warm)

    for name in [n for n, e in registry.items() if e.kind != "heuristic"]:  # the heuristics and it: no MILP here
        del registry[name]
    registry[entry.name] = replace(entry, fn=spy)
    g, p, _ = example()
    # x on the CPU: a heuristic's plan (6.5 ms) meets the floor (the chain x, op0, a's copy, op1, op2), so auto stops
    options = SolverOptions(time_limit_s=5)
    plan = solve(g, p, {"cuda:0": 600}, devices=["cuda:0", "cpu"], homes={"x": "cpu"}, options=options)
    assert plan.solver.status == "optimal" and plan.predicted.makespan_s == pytest.approx(0.0065) and not warm_starts
    # x on the GPU: no plan meets the floor, so the timed members run, the example's last, warm-started
    plan = solve(g, p, {"cuda:0": 600}, devices=["cuda:0", "cpu"], homes={"x": "cuda:0"}, options=options)
    assert [m.method for m in plan.solver.stats.members][-1] == "first-fit"
    assert len(warm_starts) == 1 and warm_starts[0] is not None


def test_the_registry_is_restored_in_order() -> None:
    """Runs after the two tests above (file order): the built-in order, which auto follows, is intact."""
    assert list(SOLVERS) == REGISTERED


def test_the_layer_table_is_test_imports_layers() -> None:
    rows = re.findall(r"^\| (\d+) \| (.*?) \|", section("Layers"), flags=re.M)
    table = [(int(n), re.findall(r"`(xsched[\w.]*)`", names)) for n, names in rows]
    assert table == list(enumerate(LAYERS))


def test_the_paths_the_doc_names_exist() -> None:
    named = set(re.findall(r"`((?:xsched|tests|docs|scripts|profiles)/[\w./-]*)`", DOC))
    assert named and not [p for p in sorted(named) if not (ROOT / p).exists()]


def test_nothing_names_a_file_outside_the_repository() -> None:
    """README, this doc and every module docstring: links resolve inside the repository, no path climbs out."""
    texts = {"README.md": (ROOT / "README.md").read_text(), "docs/ARCHITECTURE.md": DOC}
    for path in sorted((ROOT / "xsched").rglob("*.py")):
        texts[str(path.relative_to(ROOT))] = ast.get_docstring(ast.parse(path.read_text())) or ""
    for where, text in texts.items():
        assert not re.search(r"\.\./shared|kept outside|outside (this|the) repository", text), where
        base = (ROOT / where).parent
        for link in re.findall(r"\]\(([^)#\s]+)", text):
            if "://" not in link:
                target = (base / link).resolve()
                assert target.is_relative_to(ROOT) and target.exists(), f"{where}: {link}"
