"""The package's imports run downward only and never in a circle (read from the source, not by importing)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "xsched"

# Layers, lowest first: a module may import modules of its own layer or below, never above. The longest
# matching prefix decides a module's layer; the package facade `xsched` (lazy re-exports) stands outside.
LAYERS = [
    [
        "xsched.errors",
        "xsched.files",
        "xsched.budgets",
        "xsched.zoo",
        "xsched.solve.options",
        "xsched.devices.energy",
        "xsched.execute.rng",
        "xsched.execute.stores",
        "xsched.execute.workers",
    ],
    ["xsched.graph"],
    ["xsched.ops", "xsched.onnx.nodes", "xsched.plan", "xsched.profile.contract", "xsched.profile", "xsched.lanes"],
    ["xsched.capture", "xsched.importers", "xsched.interpret", "xsched.devices", "xsched.profile.model"],
    ["xsched.profile.measure", "xsched.profile.store", "xsched.simulate"],
    ["xsched.solve"],
    ["xsched.execute", "xsched.loaders", "xsched.explain", "xsched.capture.onnx"],
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


def import_graph() -> dict[str, set[str]]:
    """module -> the xsched modules it imports, at top level or inside functions."""
    mods = modules()

    def owner(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    edges: dict[str, set[str]] = {}
    for m, path in mods.items():
        package = m if path.name == "__init__.py" else m.rpartition(".")[0]
        found: set[str | None] = set()
        for node in ast.walk(ast.parse(path.read_text())):
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


def layer(module: str) -> int:
    best, rank = "", -1
    for i, names in enumerate(LAYERS):
        for name in names:
            if (module == name or module.startswith(name + ".")) and len(name) > len(best):
                best, rank = name, i
    assert rank >= 0, f"{module} is in no layer: add it to LAYERS"
    return rank


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
    """Control: the AST walk must find an import inside a function, or the two tests above prove nothing."""
    edges = import_graph()
    assert "xsched.solve.eager" in edges["xsched.cli.plan"]  # imported inside cmd_plan
    assert "xsched.zoo" in edges["xsched.loaders"]  # imported inside load_model
