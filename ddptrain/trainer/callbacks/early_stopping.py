"""Early stopping: stop training when a monitored metric has stopped improving.

The decision is taken on values reduced over every rank (``trainer.callback_metrics``), so all
ranks take it alike; the trainer still agrees on it (``trainer.should_stop`` travels in the
stop all-reduce), so every rank stops at the same step even if a user's callback sets it on
one rank only.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from ...config import MONITOR_MODES, ConfigError
from ..monitoring import missing_metric_error
from .base import Callback, EpochOrderedLines, TrainerView

log = logging.getLogger("ddptrain.trainer")

__all__ = ["EarlyStopping"]


class EarlyStopping(Callback):
    """Set ``trainer.should_stop`` when ``monitor`` has not improved for ``patience`` checks.

    A check happens after every evaluation; in a run that never evaluates, at every epoch end.

    Args:
        monitor: a key of ``trainer.callback_metrics``: ``eval/loss``, ``eval/accuracy``,
            ``train/loss``, ``train/epoch_loss`` or a name given to ``self.log``.
        mode: ``"min"`` (lower is better) or ``"max"``.
        patience: checks without improvement before stopping (0: at the first one).
        min_delta: an improvement must beat the best value by more than this.

    Raises:
        ConfigError: at the first check, when ``monitor`` was never reported (the message lists
            the metrics that were).
    """

    def __init__(self, monitor: str, mode: str = "min", patience: int = 3, min_delta: float = 0.0):
        if mode not in MONITOR_MODES:
            raise ConfigError(f"EarlyStopping(mode={mode!r}): mode must be one of {', '.join(MONITOR_MODES)}")
        if patience < 0 or min_delta < 0:
            raise ConfigError(f"EarlyStopping(patience={patience}, min_delta={min_delta}): both must be >= 0")
        self.monitor, self.mode, self.patience, self.min_delta = monitor, mode, patience, min_delta
        self.best: float | None = None
        self.best_step = -1
        self.wait = 0
        self.stopped_step: int | None = None
        """The step at which this callback asked to stop (None if it did not)."""
        self._checked_step = -1
        self.lines = EpochOrderedLines(log)

    def on_fit_start(self, trainer: TrainerView) -> None:
        self._checked_step = -1

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps (so a resumed run stops where the uninterrupted one would)."""
        return {"monitor": self.monitor, "best": self.best, "best_step": self.best_step, "wait": self.wait}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("monitor") == self.monitor:  # another metric's best means nothing here
            self.best, self.best_step, self.wait = state["best"], state["best_step"], state["wait"]

    def on_validation_end(self, trainer: TrainerView, metrics: dict[str, float]) -> None:
        self._check(trainer)

    def on_epoch_end(self, trainer: TrainerView, epoch: int, metrics: dict[str, Any]) -> None:
        if not _evaluates(trainer):
            self._check(trainer)
        self.lines.flush()  # after the epoch's line

    def improved(self, value: float) -> bool:
        """Whether ``value`` beats the best so far by more than ``min_delta``."""
        if self.best is None:
            return True
        return value < self.best - self.min_delta if self.mode == "min" else value > self.best + self.min_delta

    def _check(self, trainer: TrainerView) -> None:
        step = trainer.state.step
        if step == self._checked_step:
            return
        self._checked_step = step
        metrics = trainer.callback_metrics
        if self.monitor not in metrics:
            raise missing_metric_error("EarlyStopping", self.monitor, metrics, step)
        value = float(metrics[self.monitor])
        if math.isfinite(value) and self.improved(value):
            self.best, self.best_step, self.wait = value, step, 0
            return
        self.wait += 1
        if not math.isfinite(value) or self.wait >= self.patience:
            self.stopped_step = step
            trainer.should_stop = True
            self.lines.info(
                trainer,
                "early stopping at step %d: %s=%.6g, no improvement for %d check(s) (best %s at step %d)",
                step,
                self.monitor,
                value,
                self.wait,
                "none" if self.best is None else f"{self.best:.6g}",
                self.best_step,
            )


def _evaluates(trainer: TrainerView) -> bool:
    """Whether the run evaluates during training (else checks happen at epoch ends)."""
    t = trainer.config.trainer
    return getattr(trainer, "val_set", None) is not None and bool(t.eval_every_epochs or t.eval_every_steps)
