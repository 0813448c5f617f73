"""Objects a config names by dotted path: ``recipe.trainer_class``, ``model._target_``, a
callback's ``_target_``. Imported here, with errors that name the key (torch-free)."""

from __future__ import annotations

from typing import Any

from .config import ConfigError

__all__ = ["locate", "instantiate"]


def locate(path: str, key: str) -> Any:
    """Import ``package.module.Name`` (what a config's dotted path names).

    Raises:
        ConfigError: naming ``key``, the path and why it failed.
    """
    import importlib

    if not isinstance(path, str) or "." not in path:
        raise ConfigError(f"{key}={path!r} must be a dotted path like 'package.module.Name'")
    module_name, _, attr = path.rpartition(".")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(
            f"{key}={path}: cannot import module {module_name!r} ({exc}). The module must be "
            "importable from the working directory or the installed packages."
        ) from exc
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ConfigError(f"{key}={path}: module {module_name!r} has no attribute {attr!r}") from None


def instantiate(spec: dict, key: str, fix: str) -> Any:
    """Call what ``spec['_target_']`` names with the rest of ``spec`` (keys starting with ``_`` left out).

    Args:
        spec: e.g. ``config.model``: ``{"_target_": "pkg.module.Class", **keyword arguments}``.
        key: the config key of ``spec``, for messages (``model``).
        fix: what else the user may do when ``_target_`` is missing (e.g. override a hook).

    Raises:
        ConfigError: ``_target_`` missing or not importable.
    """
    spec = dict(spec)
    target = spec.pop("_target_", None)
    if not target:
        raise ConfigError(f"{key}._target_ is not set: choose a {key} (e.g. {key}=tutorial_net) or {fix}")
    kwargs = {k: v for k, v in spec.items() if not k.startswith("_")}
    return locate(target, f"{key}._target_")(**kwargs)
