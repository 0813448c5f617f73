"""Check command-line overrides against ddptrain's schema before Hydra sees them.

Hydra's own answer to a typo is to suggest appending the key (``+trainer.epoch=3``), which the
schema then refuses too. Here every key is checked against the config dataclasses and every
group option against the config directories, and a mistake gets "did you mean ...?" straight
away. Pure: no Hydra, no torch.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from collections.abc import Iterable, Sequence
from pathlib import Path

from ..config import Config, keys_hint, suggest_key

__all__ = ["GROUPS", "FLAGS_WITH_VALUE", "override_tokens", "config_dirs_of", "group_options", "first_problem"]

GROUPS = ("recipe", "backend", "launcher", "model", "data", "optimizer", "trainer")
"""The config groups of ddptrain's ``conf/`` (a group option is chosen with ``group=option``)."""
FLAGS_WITH_VALUE = (
    "--config-dir",
    "-cd",
    "--config-name",
    "-cn",
    "--config-path",
    "-cp",
    "--cfg",
    "-c",
    "--package",
    "-p",
    "--experimental-rerun",
)


def override_tokens(argv: Sequence[str]) -> list[str]:
    """The overrides among command-line arguments (flags and their values left out)."""
    tokens, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in FLAGS_WITH_VALUE:
            skip = True
        elif not arg.startswith("-"):
            tokens.append(arg)
    return tokens


def config_dirs_of(argv: Sequence[str], package_dir: Path) -> list[Path]:
    """ddptrain's own config directory, then the user's ``--config-dir`` ones."""
    dirs, take = [package_dir], False
    for arg in argv:
        if take:
            dirs.append(Path(arg))
            take = False
        elif arg in ("--config-dir", "-cd"):
            take = True
        elif arg.startswith("--config-dir="):
            dirs.append(Path(arg.split("=", 1)[1]))
    return dirs


def group_options(dirs: Iterable[Path]) -> dict[str, list[str]]:
    """Every group's options (YAML file names) found in ``dirs``, sorted."""
    options: dict[str, set[str]] = {}
    for directory in dirs:
        for path in Path(directory).glob("*/*.yaml"):
            options.setdefault(path.parent.name, set()).add(path.stem)
    return {group: sorted(names) for group, names in options.items()}


def _leaf_keys(cls: type, prefix: str = "") -> list[str]:
    keys = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        name = prefix + f.name
        keys += _leaf_keys(hints[f.name], name + ".") if dataclasses.is_dataclass(hints[f.name]) else [name]
    return keys


def _unknown_key(path: list[str]) -> str | None:
    """Why the dotted key ``path`` is not in the schema, or None if it is (or is free-form)."""
    cls: type = Config
    for depth, part in enumerate(path):
        hints = typing.get_type_hints(cls)
        if part not in hints:
            key = ".".join(path)
            close = difflib.get_close_matches(key, _leaf_keys(Config), n=1, cutoff=0.6)
            section = ".".join(path[:depth])
            return f"unknown config key {key}.{suggest_key(key, close)} {keys_hint(section, sorted(hints))}"
        hint = hints[part]
        if hint is dict or typing.get_origin(hint) is dict:
            return None  # free-form (model.*): whatever the model's constructor takes
        if not dataclasses.is_dataclass(hint):
            if depth < len(path) - 1:
                return f"{'.'.join(path[: depth + 1])} is a value, not a section: {'.'.join(path)} does not exist."
            return None
        cls = hint
    return None


def _unknown_option(group: str, value: str, options: dict[str, list[str]]) -> str | None:
    known = options.get(group, [])
    for choice in value.split(","):  # a sweep (-m) lists several
        choice = choice.strip()
        if not choice or "(" in choice or choice in known:
            continue
        close = difflib.get_close_matches(choice, known, n=1)
        hint = f" Did you mean {group}={close[0]}?" if close else ""
        return f"unknown {group} {choice!r}.{hint} Available: {', '.join(known) or 'none'}" + (
            " (or your own with --config-dir DIR holding recipe/<name>.yaml)." if group == "recipe" else "."
        )
    return None


def first_problem(tokens: Sequence[str], options: dict[str, list[str]]) -> str | None:
    """The first override whose key or option does not exist, as an error message; else None."""
    for token in tokens:
        key, _, value = token.lstrip("~+").partition("=")
        key = key.split("@", 1)[0]
        if key.startswith(("hydra.", "hydra/")) or key == "hydra" or "/" in key:
            continue
        if key in options or key in GROUPS:
            problem = _unknown_option(key, value, options) if "=" in token else None
        else:
            problem = _unknown_key(key.split("."))
        if problem:
            return problem
    return None
