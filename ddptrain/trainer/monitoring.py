"""Monitored metrics: the error for a metric that a callback or scheduler watches but nobody reports."""

from __future__ import annotations

import difflib
from typing import Any

from ..config import ConfigError

__all__ = ["missing_metric_error"]


def missing_metric_error(who: str, name: str, available: dict[str, Any], step: int) -> ConfigError:
    """The error for a monitored metric that was never reported: names it and lists what exists."""
    names = sorted(available)
    close = difflib.get_close_matches(name, names, n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    return ConfigError(
        f"{who} monitors {name!r}, but no metric of that name was reported by step {step}.{hint} "
        f"Available: {', '.join(names) or 'none yet'}. Monitor one of these, or report it with "
        f"self.log({name!r}, value) in training_step or validation_step."
    )
