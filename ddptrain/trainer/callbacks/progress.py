"""Progress on rank 0: a tqdm bar per epoch on a terminal; log lines every ``trainer.log_every_steps``
steps (to the console too when no bar is shown) and after every epoch."""

from __future__ import annotations

import logging
import sys
from typing import Any

from .base import Callback, TrainerView, at_epoch_end

log = logging.getLogger("ddptrain.progress")


def _fmt(metrics: dict[str, Any]) -> str:
    parts = []
    for key, value in metrics.items():
        if isinstance(value, float):
            parts.append(f"{key}={value:.4g}")
        elif isinstance(value, int) and not isinstance(value, bool):
            parts.append(f"{key}={value}")
    return " ".join(parts)


class ProgressCallback(Callback):
    """tqdm bars when stdout is a terminal (quiet in CI logs); step and epoch lines through logging.

    A step line every ``trainer.log_every_steps`` steps (none with ``0``) names the epoch the step
    belongs to and shows what was logged with ``self.log(..., prog_bar=True)``; the line of an
    epoch comes before the lines of the decisions taken at its end (best checkpoints, early
    stopping). Totals count to ``trainer.total_steps`` (``trainer.max_steps`` included).

    Args:
        bar: ``None`` decides by ``sys.stdout.isatty()``; ``True``/``False`` forces it.
    """

    def __init__(self, bar: bool | None = None):
        self.bar_enabled = bar
        self.bar = None

    def _use_bar(self) -> bool:
        if self.bar_enabled is not None:
            return self.bar_enabled
        try:
            return sys.stdout.isatty()
        except (AttributeError, ValueError):  # replaced or closed stdout
            return False

    def on_fit_start(self, trainer: TrainerView) -> None:
        if not trainer.is_main:
            return
        state, epochs = trainer.state, trainer.config.trainer.epochs
        where = f" (resumed at step {state.step}, epoch {state.epoch + 1})" if state.step else ""
        if trainer.total_steps < trainer.steps_per_epoch * epochs:  # trainer.max_steps ends it first
            plan = f"until step {trainer.total_steps} (trainer.max_steps; {trainer.steps_per_epoch} step(s) per epoch)"
        else:
            plan = f"{trainer.steps_per_epoch} step(s) per epoch, {epochs} epoch(s)"
        log.info(
            "training %s on %d rank(s), %s per rank, %s%s; output: %s",
            type(trainer).__name__,
            trainer.world_size,
            trainer.device,
            plan,
            where,
            trainer.output_dir,
        )

    def on_epoch_start(self, trainer: TrainerView, epoch: int) -> None:
        if not trainer.is_main or not self._use_bar():
            return
        from tqdm import tqdm

        self.bar = tqdm(
            total=min(trainer.steps_per_epoch, trainer.total_steps - epoch * trainer.steps_per_epoch),
            initial=trainer.steps_done_in_epoch,
            desc=f"epoch {epoch + 1}/{trainer.config.trainer.epochs}",
            unit="step",
            file=sys.stdout,
            dynamic_ncols=True,
            leave=True,
        )

    def on_train_batch_end(self, trainer: TrainerView, loss: float) -> None:
        if self.bar is not None:
            self.bar.update(1)

    def on_log(self, trainer: TrainerView, scalars: dict[str, float]) -> None:
        shown = dict(getattr(trainer, "progress_bar_metrics", {}))  # self.log(..., prog_bar=True)
        if self.bar is not None:
            self.bar.set_postfix(
                loss=f"{scalars['train/loss']:.4f}", **{k: f"{v:.4g}" for k, v in shown.items()}, refresh=False
            )
        if trainer.is_main:  # the log file always; the console only when no bar shows the same
            extra = "".join(f", {k}={v:.4g}" for k, v in shown.items())
            log.info(
                "step %d/%d (epoch %d): loss %.4f, %.0f samples/s, lr %.3g, %s/step sent%s",
                trainer.state.step,
                trainer.total_steps,
                _epoch_of_last_step(trainer),
                scalars["train/loss"],
                scalars.get("train/samples_per_s", 0.0),
                scalars.get("train/lr", 0.0),
                _bytes(scalars.get("comm/bytes_per_step", 0.0)),
                extra,
                extra={"console": self.bar is None},
            )

    def on_epoch_end(self, trainer: TrainerView, epoch: int, metrics: dict[str, Any]) -> None:
        self._close()
        if trainer.is_main:
            log.info("epoch %d/%d: %s", epoch + 1, trainer.config.trainer.epochs, _fmt(metrics))

    def on_fit_end(self, trainer: TrainerView, metrics: dict[str, Any]) -> None:
        self._close()
        if trainer.is_main:
            how = f"stopped by {metrics['stopped_by']}" if metrics.get("stopped_by") else "done"
            log.info("%s: %s", how, _fmt(metrics))

    def on_exception(self, trainer: TrainerView, exc: BaseException) -> None:
        self._close()

    def _close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def _epoch_of_last_step(trainer: TrainerView) -> int:
    """The epoch (from 1) the latest step belongs to: at an epoch's end the sampler has already
    moved to the next epoch, but the step was the last of the previous one."""
    return trainer.state.epoch + (0 if at_epoch_end(trainer) else 1)


def _bytes(n: float) -> str:
    """``n`` bytes for a log line: ``512 B``, ``1.2 kB``, ``3.4 MB``."""
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"
