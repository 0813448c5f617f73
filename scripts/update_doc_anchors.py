"""Move the ``file:line`` anchors of ``docs/*.md`` to where their code is now.

An anchor is a Markdown link to a line followed by the code on that line in backticks::

    [trainer.py:195](../ddptrain/trainer/trainer.py#L195) `def fit(self)`

``tests/unit/test_architecture_doc.py`` fails when a line no longer holds its code; this script
finds the code in the same file (the occurrence nearest the old line) and rewrites the link.

    .venv/bin/python scripts/update_doc_anchors.py
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ANCHOR = re.compile(r"\[(?P<label>[^\]:]+):(?P<line>\d+)\]\(\.\./(?P<path>[^)#]+)#L(?P<link>\d+)\) `(?P<code>[^`]+)`")


def anchors(text: str):
    """Every anchor of a page: (match, path, line, code); ``line`` is None when the label's line
    and the link's line disagree."""
    for m in ANCHOR.finditer(text):
        yield m, m["path"], int(m["line"]) if m["line"] == m["link"] else None, m["code"]


def find_line(path: Path, code: str, near: int) -> int | None:
    """The line of ``path`` (from 1) that holds ``code``, the one nearest ``near``; None if none does."""
    hits = [i for i, line in enumerate(path.read_text().splitlines(), 1) if code in line]
    return min(hits, key=lambda i: abs(i - near)) if hits else None


def _moved(m: re.Match, page: str, missing: list[str]) -> str:
    found = find_line(REPO / m["path"], m["code"], int(m["line"]))
    if found is None:
        missing.append(f"{page}: {m['path']} no longer holds `{m['code']}`")
        return m[0]
    return f"[{m['label']}:{found}](../{m['path']}#L{found}) `{m['code']}`"


def main() -> int:
    missing: list[str] = []
    for page in sorted((REPO / "docs").glob("*.md")):
        text = page.read_text()
        new = ANCHOR.sub(lambda m, name=page.name: _moved(m, name, missing), text)
        if new != text:
            page.write_text(new)
            print(f"updated {page.relative_to(REPO)}")
    for line in missing:
        print(line, file=sys.stderr)
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
