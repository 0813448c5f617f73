"""The ranking behind best checkpoints: which ``k`` values of a monitored metric to keep.

Pure bookkeeping (no files, no collectives), so the rule is tested on its own: the kept entries
are exactly the ``k`` best by value (lowest for mode ``min``, highest for ``max``); on a tie the
earlier step stays and the newcomer is refused, so the outcome never depends on timing; a NaN
value is never kept.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

__all__ = ["MODES", "Ranked", "TopK"]

MODES = ("min", "max")


@dataclass(frozen=True)
class Ranked:
    """One kept checkpoint: the monitored ``value`` at ``step``, written to ``path``."""

    value: float
    step: int
    path: Path


class TopK:
    """The ``k`` best entries by value under ``mode`` (``min`` or ``max``), best first."""

    def __init__(self, k: int, mode: str):
        if mode not in MODES:
            raise ValueError(f"mode={mode!r} must be 'min' or 'max'")
        if k < 1:
            raise ValueError(f"k={k} must be at least 1")
        self.k, self.mode = k, mode
        self.kept: list[Ranked] = []

    def key(self, value: float, step: int) -> tuple[float, int]:
        """Sort key: smaller is better (the value, negated for ``max``; then the earlier step)."""
        return (value if self.mode == "min" else -value, step)

    def accepts(self, value: float, step: int) -> bool:
        """Whether ``value`` at ``step`` would enter the top ``k`` (never a NaN, never a step already kept)."""
        if math.isnan(value) or any(r.step == step for r in self.kept):
            return False
        if len(self.kept) < self.k:
            return True
        worst = self.kept[-1]
        return self.key(value, step) < self.key(worst.value, worst.step)

    def add(self, entry: Ranked) -> list[Ranked]:
        """Insert ``entry`` (which must be accepted); returns the entries it pushes out."""
        if not self.accepts(entry.value, entry.step):
            raise ValueError(f"{entry} does not enter the top {self.k} ({self.mode})")
        self.kept = sorted([*self.kept, entry], key=lambda r: self.key(r.value, r.step))
        evicted, self.kept = self.kept[self.k :], self.kept[: self.k]
        return evicted

    @property
    def best(self) -> Ranked | None:
        return self.kept[0] if self.kept else None
