"""Layers import only downward, and no files import each other: the layer table of
docs/architecture.md, checked against every module's imports."""

from __future__ import annotations

import ast
import fnmatch
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
TABLE = REPO / "docs" / "architecture.md"
# How setup.py assembles the one import root from the repository's folders.
FOLDERS = {
    "kvserve": REPO / "protos" / "kvserve",
    "kvserve.services": REPO / "services",
    "kvserve.kvcache_service": REPO / "kvcache_service",
    "kvserve.model_service": REPO / "model_service",
    "kvserve.clients": REPO / "clients",
}


def modules() -> dict[str, Path]:
    """Every module of the installed package (folders with an __init__.py), by import name."""
    found = {}
    for root, folder in FOLDERS.items():
        for path in folder.rglob("*.py"):
            packages = [path.parent, *[p for p in path.parent.parents if folder in p.parents]]
            if not all((d / "__init__.py").is_file() for d in packages):
                continue   # a script beside the package (clients/examples/), not part of it
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([root, *parts])] = path
    return found


def layer_table() -> list[tuple[int, list[str]]]:
    """(layer, module patterns) for each row of the table under "## Layers"."""
    text = TABLE.read_text()
    section = text.split("\n## Layers\n", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 2 and cells[0].isdigit():
            rows.append((int(cells[0]), re.findall(r"`([^`]+)`", cells[1])))
    return rows


def layer_of(name: str, rows: list[tuple[int, list[str]]]) -> list[int]:
    return [layer for layer, patterns in rows if any(fnmatch.fnmatchcase(name, p) for p in patterns)]


def imports_of(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The kvserve modules `name` imports, anywhere in the file (functions and TYPE_CHECKING too).
    `from a.b import c` is an import of a.b.c where that is a module, else of a.b."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:   # relative: resolved against this module's package
                package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
                for _ in range(node.level - 1):
                    package = package.rsplit(".", 1)[0]
                base = f"{package}.{base}" if base else package
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target not in known and "." in target:
                target = target.rsplit(".", 1)[0]
            if target in known and target != name:
                out.add(target)
    return out


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports_of(name, path, known) for name, path in known.items()}


def test_the_table_places_every_module_exactly_once() -> None:
    rows = layer_table()
    assert rows, f"no layer table under '## Layers' in {TABLE}"
    misplaced = {name: layer_of(name, rows) for name in modules() if len(layer_of(name, rows)) != 1}
    assert not misplaced, ("modules in no row or in several rows of the layer table "
                           f"(docs/architecture.md): {misplaced}")


def test_no_module_imports_a_higher_layer() -> None:
    rows = layer_table()
    upward = [f"{name} (layer {layer_of(name, rows)[0]}) imports {target} (layer {layer_of(target, rows)[0]})"
              for name, targets in graph().items() for target in sorted(targets)
              if layer_of(target, rows)[0] > layer_of(name, rows)[0]]
    assert not upward, "upward imports:\n  " + "\n  ".join(upward)


def test_no_files_import_each_other() -> None:
    cycles = strongly_connected(graph())
    assert not cycles, "import cycles between files:\n  " + "\n  ".join(" -> ".join(c) for c in cycles)


def strongly_connected(edges: dict[str, set[str]]) -> list[list[str]]:
    """The cycles of the graph: its strongly connected components of more than one node
    (Tarjan), plus any node that imports itself."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(edges.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1 or node in edges.get(node, ()):
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


@pytest.mark.parametrize("edges, cycles", [
    ({"a": {"b"}, "b": {"c"}, "c": set()}, []),
    ({"a": {"b"}, "b": {"a"}}, [["a", "b"]]),
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}, [["a", "b", "c"]]),
])
def test_the_cycle_finder_finds_cycles(edges, cycles) -> None:
    assert strongly_connected(edges) == cycles


def test_the_checks_see_an_upward_import_and_a_type_checking_cycle(tmp_path: Path) -> None:
    """The parser counts imports inside functions and under TYPE_CHECKING, and resolves
    `from package import module`."""
    (tmp_path / "p").mkdir()
    (tmp_path / "p" / "__init__.py").write_text("")
    (tmp_path / "p" / "low.py").write_text("def f():\n    from p import high\n")
    (tmp_path / "p" / "high.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import p.low\n")
    known = {"p": tmp_path / "p" / "__init__.py", "p.low": tmp_path / "p" / "low.py", "p.high": tmp_path / "p" / "high.py"}
    edges = {name: imports_of(name, path, known) for name, path in known.items()}
    assert edges == {"p": set(), "p.low": {"p.high"}, "p.high": {"p.low"}}
    assert strongly_connected(edges) == [["p.high", "p.low"]]
