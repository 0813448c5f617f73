"""Progress on rank 0: a tqdm bar per epoch on a terminal; log lines every ``trainer.log_every_steps``
steps (to the console too when no bar is shown) and after every epoch."""

from __future__ import annotations

import logging
import sys
from typing import Any

from .base import Callback, TrainerView

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
    """tqdm bars when stdout is a terminal (quiet in CI logs); epoch summaries through logging.

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
        if trainer.is_main:
            state = trainer.state
            where = f" (resumed at step {state.step}, epoch {state.epoch + 1})" if state.step else ""
            log.info(
                "training %s on %d rank(s), %s per rank, %d step(s) per epoch, %d epoch(s)%s; output: %s",
                type(trainer).__name__,
                trainer.world_size,
                trainer.device,
                trainer.steps_per_epoch,
                trainer.config.trainer.epochs,
                where,
                trainer.output_dir,
            )

    def on_epoch_start(self, trainer: TrainerView, epoch: int) -> None:
        if not trainer.is_main or not self._use_bar():
            return
        from tqdm import tqdm

        self.bar = tqdm(
            total=trainer.steps_per_epoch,
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
        if self.bar is not None:
            shown = {k: f"{v:.4g}" for k, v in getattr(trainer, "progress_bar_metrics", {}).items()}
            self.bar.set_postfix(loss=f"{scalars['train/loss']:.4f}", **shown, refresh=False)
        if trainer.is_main:  # the log file always; the console only when no bar shows the same
            total = trainer.steps_per_epoch * trainer.config.trainer.epochs
            log.info(
                "step %d/%d (epoch %d): loss %.4f, %.0f samples/s, lr %.3g",
                trainer.state.step,
                total,
                trainer.state.epoch + 1,
                scalars["train/loss"],
                scalars.get("train/samples_per_s", 0.0),
                scalars.get("train/lr", 0.0),
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
