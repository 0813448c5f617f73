"""The shape of the package: short functions, classes of one job, imports that flow one way.

Counts skip docstrings (a long explanation is welcome; long code is not). The import graph
includes imports inside functions and under ``TYPE_CHECKING``: a cycle hidden by a lazy import is
still a cycle in the design.
"""

from __future__ import annotations

import ast
from pathlib import Path

import ddptrain

PACKAGE = Path(ddptrain.__file__).resolve().parent
MAX_FUNCTION_LINES = 60
MAX_CLASS_LINES = 300


def _modules() -> dict[str, ast.Module]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = ast.parse(path.read_text(), str(path))
    return found


def _docstring_lines(node: ast.AST) -> int:
    """Lines taken by the docstrings of ``node`` and of every function or class inside it."""
    total = 0
    for inner in ast.walk(node):
        if isinstance(inner, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Module)) and inner.body:
            first = inner.body[0]
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                total += first.end_lineno - first.lineno + 1
    return total


def _code_lines(node: ast.AST) -> int:
    return node.end_lineno - node.lineno + 1 - _docstring_lines(node)


def test_no_function_over_60_lines_and_no_class_over_300():
    too_long = []
    for module, tree in _modules().items():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _code_lines(node) > MAX_FUNCTION_LINES:
                too_long.append(f"{module}:{node.lineno} function {node.name}: {_code_lines(node)} lines")
            if isinstance(node, ast.ClassDef) and _code_lines(node) > MAX_CLASS_LINES:
                too_long.append(f"{module}:{node.lineno} class {node.name}: {_code_lines(node)} lines")
    assert too_long == [], "split these (limits: 60 lines a function, 300 a class, docstrings aside):\n" + "\n".join(
        too_long
    )


def _imports(module: str, tree: ast.Module, known: set[str]) -> set[str]:
    """The ddptrain modules ``module`` imports, anywhere in its file."""
    is_package = (PACKAGE.parent / Path(*module.split("."))).is_dir()
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name in known}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".") if is_package else module.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                target = f"{base}.{alias.name}"
                found.add(target if target in known else base)
    return {m for m in found if m in known and m != module}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every cycle's members (strongly connected components of more than one module)."""
    index, low, stack, on_stack, result, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                result.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return result


def test_no_import_cycles_between_modules():
    modules = _modules()
    known = set(modules)
    graph = {m: _imports(m, tree, known) for m, tree in modules.items()}
    # Python runs a package's __init__ before any module inside it: a module's import of its own
    # enclosing package is how imports work, not a dependency of the design.
    for m in graph:
        graph[m] = {t for t in graph[m] if not m.startswith(t + ".")}
    assert _cycles(graph) == [], "modules that import each other (directly or round a loop)"
