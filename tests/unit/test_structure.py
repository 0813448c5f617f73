"""The shape of the package: imports that flow one way, between modules and between packages.

The import graph includes imports inside functions and under ``TYPE_CHECKING``: a cycle hidden by
a lazy import is still a cycle in the design.
"""

from __future__ import annotations

import ast
from pathlib import Path

import ddptrain

PACKAGE = Path(ddptrain.__file__).resolve().parent


def _modules() -> dict[str, ast.Module]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = ast.parse(path.read_text(), str(path))
    return found


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


def _package_of(module: str) -> str:
    """``ddptrain.trainer.callbacks.base`` -> ``ddptrain.trainer``: the top-level subpackage (or module)."""
    return ".".join(module.split(".")[:2])


def test_no_import_cycles_between_packages():
    """The layers (comm, ddp, data, trainer, doctor, launch, cli...) depend on each other one way:
    e.g. the doctor uses the trainer's callback interface, so the trainer must not import the doctor."""
    modules = _modules()
    known = set(modules)
    graph: dict[str, set[str]] = {}
    for m, tree in modules.items():
        if m.endswith(".__main__"):
            continue  # an entry point (python -m ddptrain.doctor) sits above every layer, like the CLI
        source = _package_of(m)
        targets = {_package_of(t) for t in _imports(m, tree, known)}
        graph.setdefault(source, set()).update(t for t in targets if t != source and t != "ddptrain")
    for targets in list(graph.values()):
        for t in targets:
            graph.setdefault(t, set())
    assert _cycles(graph) == [], "packages that import each other (directly or round a loop)"


def test_no_module_but_the_trainers_own_reaches_into_a_trainers_private_members():
    """Parts talk to the Trainer through its public interface (``trainer.x``), never ``trainer._x``."""
    found = []
    for module, tree in _modules().items():
        if module == "ddptrain.trainer.trainer":
            continue
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in ("trainer", "self.trainer")
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
            ):
                found.append(f"{module}:{node.lineno} trainer.{node.attr}")
    assert found == [], "\n".join(found)
