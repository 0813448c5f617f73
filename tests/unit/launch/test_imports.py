"""The modules of ddptrain.launch import one another without a cycle, counting imports inside
functions: a lazy import only hides a cycle (spawn.py and mpi_launch.py had one)."""

from __future__ import annotations

import ast
from pathlib import Path

import ddptrain.launch

PACKAGE = "ddptrain.launch"
SOURCE = Path(ddptrain.launch.__file__).parent


def _module_name(path: Path) -> str:
    return PACKAGE if path.stem == "__init__" else f"{PACKAGE}.{path.stem}"


def _launch_imports(path: Path, modules: set[str]) -> set[str]:
    """The modules of this package that ``path`` imports, anywhere in its code."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level == 1:
                base = f"{PACKAGE}.{base}" if base else PACKAGE
            elif node.level > 1:
                continue  # outside this package
            for alias in node.names:  # "from . import spawn" imports a module, "from . import launch" a name
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
    return (found & modules) - {_module_name(path)}


def _import_graph() -> dict[str, set[str]]:
    paths = sorted(SOURCE.glob("*.py"))
    modules = {_module_name(p) for p in paths}
    return {_module_name(p): _launch_imports(p, modules) for p in paths}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` (as a path that returns to its start), or None."""
    state: dict[str, str] = {}  # "open" while on the current path, "done" once fully explored

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt, path + [nxt])):
                return found
        state[node] = "done"
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start, [start])):
            return found
    return None


def test_the_graph_sees_the_imports_that_exist():
    graph = _import_graph()
    assert f"{PACKAGE}.failures" in graph[f"{PACKAGE}.spawn"]
    assert f"{PACKAGE}.mpi_launch" in graph[f"{PACKAGE}.mpi_entry"]
    assert f"{PACKAGE}.dispatch" in graph[PACKAGE]


def test_the_cycle_finder_finds_a_lazy_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycle_among_the_launch_modules():
    cycle = _cycle(_import_graph())
    assert cycle is None, f"import cycle: {' -> '.join(cycle)}"
