"""Write docs/configuration.md from the schema (``ddptrain/config/``'s dataclasses and their
attribute docstrings). ``tests/unit/cli/test_configuration_doc.py`` fails when it is out of date.

    .venv/bin/python scripts/gen_config_docs.py
"""

from pathlib import Path

from ddptrain.cli.overrides import configuration_markdown

if __name__ == "__main__":
    target = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"
    target.write_text(configuration_markdown())
    print(f"wrote {target}")
