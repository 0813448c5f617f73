"""TensorBoard event files on rank 0: training scalars and evaluation metrics.

Scalars (x axis: optimizer steps): ``train/loss`` (mean over ranks and the logging window),
``train/lr``, ``train/samples_per_s`` (all ranks), ``train/comm_wait_s`` (rank 0's mean time per
step waiting for gradient all-reduces after backward, from DDP's iteration stats),
``train/epoch_loss``, and every evaluation metric as ``eval/<name>`` (``eval/loss``,
``eval/accuracy`` for the recipes).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .base import Callback, TrainerView


class TensorBoardCallback(Callback):
    """Write scalars with ``torch.utils.tensorboard.SummaryWriter`` (rank 0 only).

    Args:
        log_dir: default ``<output_dir>/tensorboard``.
    """

    def __init__(self, log_dir: Path | None = None):
        self.log_dir = None if log_dir is None else Path(log_dir)
        self.writer = None

    def on_fit_start(self, trainer: TrainerView) -> None:
        if not trainer.is_main:
            return
        from torch.utils.tensorboard import SummaryWriter  # imports tensorboard: rank 0 only

        if self.log_dir is None:
            self.log_dir = trainer.output_dir / "tensorboard"
        # After a resume, hide what an earlier run logged beyond the checkpoint's step.
        purge = trainer.state.step if trainer.state.step > 0 else None
        self.writer = SummaryWriter(str(self.log_dir), purge_step=purge)

    def on_log(self, trainer: TrainerView, scalars: dict[str, float]) -> None:
        self._write(trainer, scalars)

    def on_validation_end(self, trainer: TrainerView, metrics: dict[str, float]) -> None:
        self._write(trainer, metrics)

    def on_epoch_end(self, trainer: TrainerView, epoch: int, metrics: dict[str, Any]) -> None:
        if "train/epoch_loss" in metrics:
            self._write(trainer, {"train/epoch_loss": metrics["train/epoch_loss"]})
        if self.writer is not None:
            self.writer.flush()

    def _write(self, trainer: TrainerView, scalars: dict[str, float]) -> None:
        if self.writer is None:
            return
        for name, value in scalars.items():
            self.writer.add_scalar(name, float(value), trainer.state.step)

    def on_fit_end(self, trainer: TrainerView, metrics: dict[str, Any]) -> None:
        self._close()

    def on_exception(self, trainer: TrainerView, exc: BaseException) -> None:
        self._close()

    def _close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
