"""Periodic checkpoints: every N epochs and/or steps and at the end, last k kept, rank 0 writes.

Saving is collective (every rank contributes its RNG state), so this callback runs on every
rank; only rank 0 touches the disk. Older checkpoints are deleted only after the new one is
written and verified, so a failed write never costs the previous checkpoint.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from ..checkpoint_io import checkpoint_name, load_checkpoint, prune_checkpoints
from .base import Callback, TrainerView

log = logging.getLogger("ddptrain.checkpoint")


class CheckpointCallback(Callback):
    """Write ``<directory>/step_<step>.pt`` (+ ``.sha256``) through ``Trainer.save_checkpoint``.

    Args:
        directory: where checkpoints go (default: the trainer's ``checkpoint_dir``).
        every_epochs: after every this many epochs (0: never at epoch ends).
        every_steps: after every this many optimizer steps (0: never mid-epoch).
        at_end: when training stops, unless the newest checkpoint is already of the last step.
        keep_last: how many checkpoints to keep.
    """

    def __init__(
        self,
        directory: Path | None = None,
        every_epochs: int = 1,
        every_steps: int = 0,
        at_end: bool = True,
        keep_last: int = 3,
    ):
        self.directory = None if directory is None else Path(directory)
        self.every_epochs = every_epochs
        self.every_steps = every_steps
        self.at_end = at_end
        self.keep_last = keep_last
        self.last_saved: tuple[int, int, int] | None = None
        self.saved: list[Path] = []

    def on_fit_start(self, trainer: TrainerView) -> None:
        if self.directory is None:
            self.directory = trainer.checkpoint_dir
        # A resumed run does not rewrite the checkpoint it started from.
        self.last_saved = trainer.state.position()

    def on_train_batch_end(self, trainer: TrainerView, loss: float) -> None:
        if self.every_steps and trainer.state.step % self.every_steps == 0:
            self.save(trainer)

    def on_epoch_end(self, trainer: TrainerView, epoch: int, metrics: dict[str, Any]) -> None:
        if self.every_epochs and (epoch + 1) % self.every_epochs == 0:
            self.save(trainer)

    def on_fit_end(self, trainer: TrainerView, metrics: dict[str, Any]) -> None:
        if self.at_end:
            self.save(trainer)

    def save(self, trainer: TrainerView) -> Path | None:
        """Save now (a collective: every rank must call it at the same step)."""
        if self.last_saved == trainer.state.position():
            return None
        path = trainer.save_checkpoint(self.directory / checkpoint_name(trainer.state.step))
        self.last_saved = trainer.state.position()
        if trainer.is_main:
            load_checkpoint(path)  # verify what reached the disk before deleting anything older
            self.saved.append(path)
            for old in prune_checkpoints(self.directory, self.keep_last):
                log.debug("deleted old checkpoint %s", old)
        return path
