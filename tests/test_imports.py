"""The package's imports run downward only and never in a circle, imports for annotations (`if TYPE_CHECKING:`)
included (read from the source, not by importing); `xsched/solve/` keeps its roles in folders."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "xsched"

# Layers, lowest first: a module may import modules of its own layer or below, never above. Each entry is a package
# or a top-level module, and a module's layer is its entry's; the package facade `xsched` (lazy re-exports) stands
# outside. docs/ARCHITECTURE.md ("Layers") says what each layer owns.
LAYERS = [
    ["xsched.errors", "xsched.files", "xsched.budgets", "xsched.zoo"],
    ["xsched.contracts"],
    ["xsched.lanes", "xsched.interpret", "xsched.capture", "xsched.importers", "xsched.devices"],
    ["xsched.simulate", "xsched.allocator", "xsched.profiling"],
    ["xsched.solve"],
    ["xsched.pipeline", "xsched.explain", "xsched.loaders"],
    ["xsched.execute"],
    ["xsched.report", "xsched.train", "xsched.demo", "xsched.onnx"],
    ["xsched.cli"],
]


def modules() -> dict[str, Path]:
    out = {}
    for p in PACKAGE.rglob("*.py"):
        parts = list(p.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


@functools.cache  # parsing every module takes seconds; the tests only read the graph
def import_graph(annotations: bool = True) -> dict[str, set[str]]:
    """module -> the xsched modules it imports, at top level or inside functions, and under `if TYPE_CHECKING:`
    unless `annotations` is off."""
    mods = modules()

    def owner(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    edges: dict[str, set[str]] = {}
    for m, path in mods.items():
        package = m if path.name == "__init__.py" else m.rpartition(".")[0]
        found: set[str | None] = set()
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree) if annotations else _runtime_nodes(tree):
            if isinstance(node, ast.Import):
                found.update(owner(a.name) for a in node.names if a.name.startswith("xsched"))
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                if base.startswith("xsched"):
                    found.update(f"{base}.{a.name}" if f"{base}.{a.name}" in mods else owner(base) for a in node.names)
        edges[m] = {x for x in found if x is not None and x != m}
    return edges


def entry(module: str) -> str:
    """The package or top-level module a module belongs to: `xsched.solve.hier.leaf` -> `xsched.solve`."""
    return ".".join(module.split(".")[:2])


def _runtime_nodes(tree: ast.AST):
    """Every node, except what sits under `if TYPE_CHECKING:` (imports for annotations only, never run)."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            test = child.test if isinstance(child, ast.If) else None
            if isinstance(test, ast.Name) and test.id == "TYPE_CHECKING":
                todo.extend(child.orelse)
                continue
            todo.append(child)


def layer(module: str) -> int:
    ranks = [i for i, names in enumerate(LAYERS) if entry(module) in names]
    assert ranks, f"{entry(module)} is in no layer: add it to LAYERS"
    return ranks[0]


def test_no_import_cycles() -> None:
    edges = import_graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        path.append(m)
        for n in sorted(edges.get(m, ())):
            if state.get(n) == 1:
                cycle = path[path.index(n) :] + [n]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if n not in state:
                visit(n)
        path.pop()
        state[m] = 2

    for m in sorted(edges):
        if m not in state:
            visit(m)


def test_imports_only_run_downward() -> None:
    upward = [
        f"{m} (layer {layer(m)}) imports {n} (layer {layer(n)})"
        for m, ns in import_graph().items()
        if m != "xsched"
        for n in ns
        if n != "xsched" and layer(n) > layer(m)
    ]
    assert not upward, "upward imports:\n" + "\n".join(sorted(upward))


def test_the_walk_sees_function_level_and_relative_imports(tmp_path) -> None:
    """Control: the AST walk must find an import inside a function and one under TYPE_CHECKING, or the two tests
    above prove nothing."""
    edges = import_graph()
    assert "xsched.solve.reference" in edges["xsched.cli.plan"]  # imported inside cmd_plan
    assert "xsched.zoo" in edges["xsched.loaders"]  # imported inside load_model
    assert "xsched.errors" in edges["xsched.contracts.result"]  # under TYPE_CHECKING, for `SolveResult.error`
    assert "xsched.errors" not in import_graph(annotations=False)["xsched.contracts.result"]


def test_the_plan_and_its_record_do_not_import_each_other() -> None:
    """A plan carries its solver's record; the record holds no plan (a solver returns both as an `Outcome`)."""
    edges = import_graph()
    assert "xsched.contracts.result" in edges["xsched.contracts.plan"]
    assert "xsched.contracts.plan" not in edges["xsched.contracts.result"]


MAX_SOLVE_MODULES = 12  # modules directly in xsched/solve/ (its __init__ included): the rest sit in role folders


def test_the_solver_folder_keeps_its_roles_in_folders() -> None:
    top = sorted(p.name for p in (PACKAGE / "solve").glob("*.py"))
    assert len(top) <= MAX_SOLVE_MODULES, f"{len(top)} modules directly in xsched/solve/: {top}"
    folders = {p.name for p in (PACKAGE / "solve").iterdir() if (p / "__init__.py").exists()}
    assert {"heuristics", "milp", "intervals", "hier", "bounds", "order"} <= folders


def test_layers_name_each_package_once() -> None:
    """LAYERS lists every package and top-level module of xsched once, and nothing else."""
    listed = [name for names in LAYERS for name in names]
    found = {entry(m) for m in modules() if m != "xsched"}
    assert len(listed) == len(set(listed)), "an entry is listed twice"
    assert set(listed) == found, f"missing: {sorted(found - set(listed))}, stale: {sorted(set(listed) - found)}"
