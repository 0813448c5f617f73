"""The README and the guides in docs/ are true to the code: every ddptrain command in them is
accepted by the CLI's own checks and composes into a configuration that validates (world size
against the batch...)."""

from __future__ import annotations

import re
import shlex

import pytest

from ddptrain.cli import _check_command_line
from ddptrain.cli.app import compose_config, to_config
from ddptrain.preflight import validate
from tests.conftest import REPO

README = "\n".join(p.read_text() for p in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))])


def _shell_blocks(text: str) -> list[str]:
    return re.findall(r"```bash\n(.*?)```", text, re.S)


def _commands(text: str) -> list[list[str]]:
    """The argument lists given to ddptrain in the README's shell blocks."""
    found = []
    for block in _shell_blocks(text):
        for line in block.replace("\\\n", " ").splitlines():
            code = line.split(" #", 1)[0].strip()
            words = shlex.split(code) if code else []
            for marker in ("ddptrain", "scripts/run.sh"):
                if marker in words:  # the last: `ddptrain torchrun ... -m ddptrain recipe=...`
                    args = words[len(words) - words[::-1].index(marker) :]
                    found.append(args[1:] if args[:1] == ["doctor"] else args)
                    break
    return found


COMMANDS = _commands(README)


def _first_sweep_point(args: list[str]) -> list[str]:
    # a sweep's values are comma-separated; a list value ([2,1]) is one value
    first = [a.split(",")[0] if "=" in a and not a.partition("=")[2].startswith("[") else a for a in args]
    return [a for a in first if a not in ("-m", "--multirun")]


def test_the_readme_has_commands():
    assert len(COMMANDS) >= 10, COMMANDS


@pytest.mark.parametrize("args", COMMANDS, ids=[" ".join(a) or "(none)" for a in COMMANDS])
def test_every_readme_command_passes_the_cli_checks(args, monkeypatch):
    import ddptrain.preflight

    monkeypatch.setattr(ddptrain.preflight, "check_device", lambda *a, **k: None)  # GPU commands, on any machine
    if not args or args[0] in ("--version", "--help"):
        return
    assert _check_command_line(args) is None
    config = to_config(compose_config(_first_sweep_point(args)), None)
    validate(config, config.dist.world_size)
