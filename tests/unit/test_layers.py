"""The layering claim of docs/architecture.md, tested: its layer table, read from the page itself,
lists every package of ddptrain once, and no module imports a package of a layer above its own.

Entry points (``__main__`` modules: ``python -m ddptrain.doctor``) sit above every layer, as the
command line does. Imports inside functions and under ``TYPE_CHECKING`` count: a lazy import is
still a dependency of the design.
"""

from __future__ import annotations

import re
from pathlib import Path

from tests.unit.test_structure import PACKAGE, _imports, _modules

PAGE = PACKAGE.parent / "docs" / "architecture.md"


def _layers() -> list[tuple[str, list[str]]]:
    """The table's rows, top layer first: (layer name, the packages and modules it names)."""
    rows = []
    for line in PAGE.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[1].startswith("`ddptrain"):
            paths = re.findall(r"`(ddptrain[\w/.]*)`", cells[1])
            names = [p.rstrip("/").removesuffix(".py").replace("/", ".").removesuffix(".__init__") for p in paths]
            rows.append((cells[0], names))
    return rows


def _owner(module: str) -> str:
    """The package or top-level module a module belongs to in the table."""
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 else module


def test_the_layer_table_names_every_package_once():
    named = [p for _, packages in _layers() for p in packages]
    assert len(named) == len(set(named)), f"named twice: {sorted(p for p in named if named.count(p) > 1)}"
    present = {_owner(m) for m in _modules()}
    assert set(named) == present, f"missing from the table: {sorted(present - set(named))}; " + (
        f"not in the package: {sorted(set(named) - present)}"
    )


def test_no_module_imports_a_layer_above_its_own():
    level = {p: i for i, (_, packages) in enumerate(_layers()) for p in packages}  # 0: the top
    modules = _modules()
    known = set(modules)
    upward = []
    for module, tree in modules.items():
        if module.endswith(".__main__"):
            continue  # an entry point sits above every layer
        mine = level[_owner(module)]
        for target in _imports(module, tree, known):
            if level[_owner(target)] < mine:
                upward.append(
                    f"{module} ({_layers()[mine][0]}) imports {target} ({_layers()[level[_owner(target)]][0]})"
                )
    assert upward == [], "\n".join(sorted(upward))


def test_the_table_is_read():
    """The page's table has the layers this test relies on (a reworded page would make the two
    tests above vacuous)."""
    names = [name for name, _ in _layers()]
    assert len(names) >= 8 and Path(PAGE).exists(), names
