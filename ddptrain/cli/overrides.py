"""Check command-line overrides against ddptrain's schema before Hydra sees them.

Hydra's own answer to a typo is to suggest appending the key (``+trainer.epoch=3``), which the
schema then refuses too. Here every key is checked against the config dataclasses and every
group option against the config directories, and a mistake gets "did you mean ...?" straight
away. :func:`describe_topic` prints a key's or a section's documentation (``--help KEY``) from
the attribute docstrings of those dataclasses. Pure: no Hydra, no torch.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import inspect
import json
import textwrap
import typing
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

from ..config import Config, field_type_text, keys_hint, suggest_key, unknown_key_message

__all__ = [
    "GROUPS",
    "FLAGS_WITH_VALUE",
    "override_tokens",
    "free_form_keys_added",
    "config_dirs_of",
    "flags_first",
    "group_options",
    "first_problem",
    "describe_topic",
]

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


def _classified(argv: Sequence[str]) -> list[tuple[str, bool]]:
    """Each argument, and whether it is an override (else a flag, or the value of one of
    :data:`FLAGS_WITH_VALUE`; another flag's next argument, ``--help KEY``'s key, is an override)."""
    out, value_next = [], False
    for arg in argv:
        if value_next:
            out.append((arg, False))
            value_next = False
        elif arg.startswith("-"):
            out.append((arg, False))
            value_next = arg in FLAGS_WITH_VALUE
        else:
            out.append((arg, True))
    return out


def override_tokens(argv: Sequence[str]) -> list[str]:
    """The overrides among command-line arguments (flags and their values left out)."""
    return [arg for arg, override in _classified(argv) if override]


def flags_first(argv: Sequence[str]) -> list[str]:
    """``argv`` with every flag (and a flag's value) before the overrides, each kind in its order:
    Hydra's argparse takes its overrides as one run of positionals, so ``a=1 --config-dir D b=2``
    would leave ``b=2`` unrecognised, where a user expects a flag to go anywhere."""
    classified = _classified(argv)
    return [arg for arg, override in classified if not override] + [arg for arg, override in classified if override]


FREE_FORM = ("recipe.params.",)
"""Sections whose keys are the user's own (free-form dicts): a key there may be new."""


def free_form_keys_added(argv: Sequence[str]) -> list[str]:
    """``argv`` with each plain override of a free-form key (``recipe.params.gamma=0.7``) made
    ``++``: Hydra refuses a key its config does not have yet unless told to add it, and one's own
    hyperparameter is new by nature (``+`` and ``++`` spellings are left as written)."""
    return [
        f"++{arg}" if override and "=" in arg and arg.startswith(FREE_FORM) else arg
        for arg, override in _classified(argv)
    ]


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


def _unknown_key(path: list[str]) -> str | None:
    """Why the dotted key ``path`` is not in the schema, or None if it is (or is free-form)."""
    cls: type = Config
    for depth, part in enumerate(path):
        hints = typing.get_type_hints(cls)
        if part not in hints:
            return unknown_key_message(".".join(path), ".".join(path[:depth]), list(hints))
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


# -- the schema's documentation: python -m ddptrain --help KEY ----------------------------------
@functools.cache  # reading and parsing the source is the slow part of --help; the schema is fixed
def _attribute_docs(cls: type) -> dict[str, str]:
    """The string literal right after each field of the dataclass ``cls``, read from its source."""
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
    docs = {}
    for node, after in zip(body, body[1:]):
        is_doc = isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and is_doc:
            docs[node.target.id] = inspect.cleandoc(str(after.value.value))
    return docs


def _value_text(value: object) -> str:
    """A default as it is written on the command line (``null``, ``true``, ``[0.9, 0.999]``)."""
    if value is None or isinstance(value, (bool, list, dict)):
        return json.dumps(value)
    return str(value)


def _key_summary(f: dataclasses.Field) -> tuple[str, str]:
    """``(type and rule, default as written on the command line)`` of one schema field."""
    default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
    return field_type_text(f), _value_text(default)


def schema_entries(cls: type, prefix: str = "") -> Iterator[tuple[str, str | None, str | None, str]]:
    """Every key under the dataclass ``cls``, depth first: ``(dotted name, type and rule, default as
    written on the command line, docstring)``; a nested section comes as ``(name, None, None, its
    docstring)`` before its keys."""
    hints, docs = typing.get_type_hints(cls), _attribute_docs(cls)
    for f in dataclasses.fields(cls):
        name, doc = prefix + f.name, docs.get(f.name, "(undocumented)")
        if dataclasses.is_dataclass(hints[f.name]):
            yield name, None, None, doc
            yield from schema_entries(hints[f.name], name + ".")
            continue
        yield name, *_key_summary(f), doc


def _describe_fields(cls: type, prefix: str) -> list[str]:
    """Every key under the dataclass ``cls``: name, type, default and docstring; sections nested."""
    lines: list[str] = []
    for name, type_, default, doc in schema_entries(cls, prefix):
        if type_ is None:
            lines += ["", f"{name}: {doc}"]
        else:
            lines += [f"{name} ({type_}, default: {default})", *("    " + ln for ln in doc.splitlines())]
    return lines


def configuration_markdown() -> str:
    """``docs/configuration.md``: every key of the schema, by section (``scripts/gen_config_docs.py``)."""
    out = [
        "# Configuration reference",
        "",
        "Generated from the schema (`ddptrain/config/`) by `.venv/bin/python scripts/gen_config_docs.py`;",
        "a test fails when it is out of date. The same text, for one key or section, comes from",
        "`python -m ddptrain --help trainer.max_steps` or `python -m ddptrain --help trainer`. Defaults are",
        "the schema's; a recipe (`recipe=mnist`) may change them: `python -m ddptrain recipe=mnist --cfg job`",
        "prints the composed values.",
    ]
    docs = _attribute_docs(Config)
    for section in dataclasses.fields(Config):
        out += ["", f"## `{section.name}`", "", " ".join(docs.get(section.name, "").split()), ""]
        cls = typing.get_type_hints(Config)[section.name]
        if not dataclasses.is_dataclass(cls):
            continue
        for name, type_, default, doc in schema_entries(cls, section.name + "."):
            text = " ".join(doc.split())
            if type_ is None:
                out += ["", f"### `{name}`", "", text, ""]
            else:
                out.append(f"- **`{name}`** (`{type_}`, default `{default}`): {text}")
    return "\n".join(out) + "\n"


def describe_topic(topic: str, options: dict[str, list[str]]) -> tuple[str | None, str | None]:
    """``(text, None)``: the documentation of a key, a section or a config group; ``(None, problem)``
    for a name the schema does not have (with the same "did you mean" as a typo)."""
    path, cls, lines = topic.split("."), Config, []
    for depth, part in enumerate(path):
        hints, docs = typing.get_type_hints(cls), _attribute_docs(cls)
        if part not in hints:
            if depth == 0 and part in options:  # a group without a section of its own (backend)
                return f"{part}: config group; choose one with {part}=<name>: {', '.join(options[part])}.", None
            if depth == 0:  # a section or group misspelt: suggest those, not a key deep inside one
                close = difflib.get_close_matches(part, sorted(set(hints) | set(options)), n=1)
                return None, f"unknown config key or group {part}.{suggest_key(part, close)} {keys_hint('', hints)}"
            return None, _unknown_key(path)
        hint, name = hints[part], ".".join(path[: depth + 1])
        if not dataclasses.is_dataclass(hint):
            if depth < len(path) - 1 and not (hint is dict or typing.get_origin(hint) is dict):
                return None, _unknown_key(path)
            type_text, default = _key_summary(next(f for f in dataclasses.fields(cls) if f.name == part))
            lines = [f"{name} ({type_text}, default: {default})", *("    " + ln for ln in docs[part].splitlines())]
            break
        lines = [f"{name}: {docs.get(part, '')}", *_describe_fields(hint, name + ".")]
        cls = hint
    if len(path) == 1 and path[0] in options:
        lines.append(f"Options ({path[0]}=<name>, each sets several keys): {', '.join(options[path[0]])}.")
    lines += [
        "",
        "Defaults are the schema's; a recipe or option may change them (`python -m ddptrain recipe=<name> "
        "--cfg job` prints the composed values). Set a key with key=value, e.g. trainer.max_steps=100.",
    ]
    return "\n".join(lines), None
