"""Periodic checkpoints: *when* to save (every N epochs and/or steps, and at the end).

*How* (the file's name, the collective write, verifying it, pruning old ones, never rewriting the
state a run resumed from) is the :class:`~ddptrain.trainer.checkpoint.Checkpointer`'s
``save_step``; this callback only decides when to call it. Saving is collective, so this callback
runs on every rank.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .base import Callback, TrainerView


class CheckpointCallback(Callback):
    """Write ``<directory>/step_<step>.pt`` (+ ``.sha256``) through ``trainer.checkpointer.save_step``.

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
        self.saved: list[Path] = []

    def on_fit_start(self, trainer: TrainerView) -> None:
        trainer.checkpointer.keep_step_checkpoints(self.directory, self.keep_last)
        self.directory = trainer.checkpointer.steps_dir

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
        """Save now, unless this state is already saved (a collective: every rank must call it at the same step)."""
        path = trainer.checkpointer.save_step()
        if path is not None:
            self.saved.append(path)
        return path
