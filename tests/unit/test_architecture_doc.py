"""docs/architecture.md traces one step through the code with ``file:line`` anchors: each must
still point at its code (``scripts/update_doc_anchors.py`` moves them)."""

import importlib.util

from tests.conftest import REPO

_spec = importlib.util.spec_from_file_location("update_doc_anchors", REPO / "scripts" / "update_doc_anchors.py")
anchors_tool = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(anchors_tool)


def test_every_anchor_in_docs_points_at_its_code():
    wrong, count = [], 0
    for page in sorted((REPO / "docs").glob("*.md")):
        for _, path, line, code in anchors_tool.anchors(page.read_text()):
            count += 1
            lines = (REPO / path).read_text().splitlines()
            if line is None or not (0 < line <= len(lines) and code in lines[line - 1]):
                wrong.append(f"{page.name}: {path}:{line} does not hold `{code}`")
    assert wrong == [], "run .venv/bin/python scripts/update_doc_anchors.py:\n" + "\n".join(wrong)
    assert count >= 15  # the step trace of architecture.md: loop, DDP, reducer, process group, backends


def test_the_trace_walks_the_layers_in_order():
    text = (REPO / "docs" / "architecture.md").read_text()
    order = [path for _, path, _, _ in anchors_tool.anchors(text)]
    layers = ("ddptrain/trainer/trainer.py", "ddptrain/ddp/module.py", "ddptrain/ddp/reducer.py")
    firsts = [order.index(p) for p in layers]
    assert firsts == sorted(firsts)
    assert "ddptrain/comm/process_group.py" in order and any(p.startswith("ddptrain/comm/backends/") for p in order)
