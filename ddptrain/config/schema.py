"""The schema's machinery: how a config field states its rule, and how the rules are enforced.

A field's rule is written once, next to its default, as field metadata: its choices
(:func:`one_of`), its bounds (:func:`bounded`), or a function of its own
(``field(metadata={"check": f})``, ``f(key, value, section)``, where ``section`` is the dataclass
holding the field, for a rule that reads a sibling). :func:`check_fields` enforces them; ``--help
KEY`` and ``docs/configuration.md`` print them (:func:`field_type_text`). Torch-free.
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import field
from typing import Any

__all__ = ["ConfigError", "one_of", "bounded", "checked", "check_fields", "choices", "field_type_text"]


class ConfigError(ValueError):
    """A configuration value is unknown, of the wrong type, or inconsistent with the job."""


def one_of(default: Any, choices: tuple, fold_case: bool = False) -> Any:
    """A dataclass field that takes one of ``choices`` (strings, or numbers such as a stage).
    :func:`check_fields` enforces it, with a "did you mean"; ``--help KEY`` lists the choices.
    ``fold_case``: :meth:`Config.from_dict` lowers the value first (``trainer.progress=False``
    on a command line arrives as the string ``False``)."""
    assert default in choices, (default, choices)
    return field(default=default, metadata={"choices": choices, "fold_case": fold_case})


def bounded(default: Any, *, at_least: float | None = None, above: float | None = None, fix: str = "") -> Any:
    """A dataclass field whose value must be ``>= at_least`` (or ``> above``); ``None`` passes when
    the field is optional. ``fix`` ends the error text, separator included (``", or null for no
    limit"``). :func:`check_fields` enforces it; ``--help KEY`` shows it."""
    rule = {"at_least": at_least, "above": above, "fix": fix}
    return field(default=default, metadata={"bound": rule})


def checked(
    check: Any, rule: str, default: Any = dataclasses.MISSING, default_factory: Any = dataclasses.MISSING
) -> Any:
    """A dataclass field whose rule is the function ``check(key, value, section)`` (raising a
    :class:`ConfigError`; ``section`` is the dataclass holding the field, for a rule that reads a
    sibling); :func:`check_fields` runs it. ``rule`` says it in a few words for ``--help KEY``.
    Give ``default`` or ``default_factory``."""
    return field(default=default, default_factory=default_factory, metadata={"check": check, "rule": rule})


def choices(cls: type, name: str) -> tuple:
    """The values the :func:`one_of` field ``name`` of the dataclass ``cls`` accepts (the schema's own list)."""
    return next(f for f in dataclasses.fields(cls) if f.name == name).metadata["choices"]


def field_type_text(f: dataclasses.Field) -> str:
    """A schema field's type with its rule, as ``--help`` shows it: ``one of: sgd, adam, adamw``,
    ``int, >= 1``, ``float | None, > 0``, a :func:`checked` field's rule, or just ``bool``."""
    if "choices" in f.metadata:
        return "one of: " + ", ".join(map(str, f.metadata["choices"]))
    if "rule" in f.metadata:
        return f"{f.type}, {f.metadata['rule']}"
    bound = f.metadata.get("bound")
    if bound is None:
        return str(f.type)
    rule = f">= {bound['at_least']:g}" if bound["at_least"] is not None else f"> {bound['above']:g}"
    return f"{f.type}, {rule}"


def check_fields(obj: Any, prefix: str = "") -> None:
    """Enforce every field's own rule (its :func:`one_of` choices, its :func:`bounded` limits, or a
    ``check`` function in its metadata) on the dataclass tree ``obj``, depth first.

    Raises:
        ConfigError: the first field that breaks its rule, naming key, value and what is accepted.
    """
    for f in dataclasses.fields(obj):
        key, value = prefix + f.name, getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            check_fields(value, key + ".")
        elif "choices" in f.metadata:
            allowed = f.metadata["choices"]
            if value not in allowed:
                close = difflib.get_close_matches(str(value), list(map(str, allowed)), n=1)
                hint_text = f" (did you mean {close[0]}?)" if close else ""
                raise ConfigError(f"{key}={value!r} is not one of {', '.join(map(str, allowed))}{hint_text}")
        elif "check" in f.metadata:  # a rule of its own, written as a function next to the field
            f.metadata["check"](key, value, obj)
        elif "bound" in f.metadata and value is not None:
            bound = f.metadata["bound"]
            low, above, fix = bound["at_least"], bound["above"], bound["fix"]
            if low is not None and value < low:
                raise ConfigError(f"{key}={value} must be {'at least 1' if low == 1 else f'>= {low:g}'}{fix}")
            if above is not None and value <= above:
                raise ConfigError(f"{key}={value} must be {'positive' if above == 0 else f'> {above:g}'}{fix}")
