"""The callback interface, and what a callback may use of the trainer that runs it.

Every hook runs on every rank, so a callback may use collectives (all ranks reach the same hooks
at the same steps); one that writes files or prints checks ``trainer.is_main`` first.

Order within one fit: ``on_fit_start`` → per epoch ``on_epoch_start`` → per optimizer step
``on_train_batch_end`` (and ``on_log`` every ``trainer.log_every_steps``) → ``on_validation_end``
after each evaluation → ``on_epoch_end`` → ... → ``on_fit_end``. ``on_exception`` replaces
``on_fit_end`` when training fails.

Hooks receive the trainer as a :class:`TrainerView`: the few things callbacks need, written down
here so that this package depends on that list, not on the whole ``Trainer`` (which imports the
callbacks). Any ``ddptrain.Trainer`` is one; a test may pass any object that has these.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from ...config import Config
from ...rundir import RunDir
from ..checkpoint import Checkpointer, TrainState


@runtime_checkable
class TrainerView(Protocol):
    """What callbacks use of the trainer: where training stands, where files go, saving.

    Attributes:
        config: the run's configuration.
        state: step, epoch and position in the epoch (:class:`~ddptrain.trainer.TrainState`).
        world_size: number of ranks.
        device: this rank's device.
        output_dir: the run's directory (the same on every rank).
        steps_per_epoch: optimizer steps in a full epoch.
        total_steps: the step the run ends at, unless stopped earlier (epochs, capped by
            ``trainer.max_steps``).
        callback_metrics: the latest value of every metric, reduced over all ranks (the same on
            every rank): ``train/*`` at each logging point, ``eval/*`` after each evaluation,
            ``train/epoch_loss`` at epoch ends, and what ``self.log`` reported.
        progress_bar_metrics: (optional) the latest values of what was logged with ``prog_bar=True``.
        should_stop: set it to True to stop training; the ranks agree on it, so all stop at the
            same step (after the next step when set during a step; before the next step when set
            at an evaluation or an epoch end).
        process_group: the ranks of the job (for a callback that must agree on a decision).
        checkpointer: the fit's checkpoints (:class:`~ddptrain.trainer.checkpoint.Checkpointer`:
            ``save_step``, ``save_best``...), set before ``on_fit_start``.
    """

    config: Config
    state: TrainState
    world_size: int
    device: torch.device
    output_dir: Path
    steps_per_epoch: int
    total_steps: int
    callback_metrics: dict[str, float]
    should_stop: bool
    process_group: Any
    checkpointer: Checkpointer

    @property
    def is_main(self) -> bool:
        """True on rank 0, the rank that writes files and prints."""

    @property
    def checkpoint_dir(self) -> Path:
        """Where checkpoints go (``<output_dir>/checkpoints``)."""

    @property
    def run_dir(self) -> RunDir:
        """The paths of the run's files under ``output_dir`` (:class:`ddptrain.rundir.RunDir`)."""

    @property
    def steps_done_in_epoch(self) -> int:
        """Optimizer steps of the current epoch already done (more than 0 after a mid-epoch resume)."""

    def save_checkpoint(self, path: str | Path, extra: dict[str, Any] | None = None) -> Path:
        """Write a checkpoint to ``path`` (plus ``extra`` entries); collective: all ranks call it at one step."""


class Callback:
    """Base class: override the hooks you need; each default does nothing."""

    implements: tuple[str, ...] = ()
    """Config keys whose work this callback does (e.g. the doctor's ``trainer.doctor``): the
    Trainer refuses a config that turns such a key on when no callback of the fit implements it."""

    def on_fit_start(self, trainer: TrainerView) -> None:
        """Everything is built (and resumed); no step has run yet in this fit."""

    def on_epoch_start(self, trainer: TrainerView, epoch: int) -> None:
        """Epoch ``epoch`` (0-based) starts, possibly in its middle after a resume."""

    def on_train_batch_end(self, trainer: TrainerView, loss: float) -> None:
        """An optimizer step finished; ``loss`` is this rank's mean over its micro-batches and
        ``trainer.state.step`` counts the steps done."""

    def on_log(self, trainer: TrainerView, scalars: dict[str, float]) -> None:
        """Scalars reduced over all ranks (``train/loss``, ``train/lr``, ...), at ``trainer.state.step``."""

    def on_validation_end(self, trainer: TrainerView, metrics: dict[str, float]) -> None:
        """An evaluation finished; ``metrics`` are exact over the whole validation set."""

    def on_epoch_end(self, trainer: TrainerView, epoch: int, metrics: dict[str, Any]) -> None:
        """Epoch ``epoch`` is complete (``trainer.state.epoch`` is already the next one)."""

    def on_fit_end(self, trainer: TrainerView, metrics: dict[str, Any]) -> None:
        """Training stopped normally; ``metrics`` is what ``fit`` returns."""

    def on_exception(self, trainer: TrainerView, exc: BaseException) -> None:
        """Training failed with ``exc`` (it is re-raised after the callbacks ran)."""

    def on_membership_change(self, trainer: TrainerView, change: Any) -> None:
        """An elastic job (``trainer.elastic``) lost or took in members: ``trainer.rank`` and
        ``world_size`` are the new ones, and the state is the one the members agreed on
        (``change``: :class:`ddptrain.trainer.elastic.MembershipChange`). A rank that has just become
        rank 0 takes over rank 0's duties here (the loggers open their files)."""


def at_epoch_end(trainer: TrainerView) -> bool:
    """Whether the latest step closed an epoch (the sampler has already moved to the next one)."""
    return trainer.state.step > 0 and trainer.steps_done_in_epoch == 0


class EpochOrderedLines:
    """A callback's log lines in the order a reader follows: one about a decision taken at an
    epoch's end (its evaluation) waits for that epoch's summary line, which the progress callback
    (the first callback) prints in ``on_epoch_end``; call :meth:`flush` from your ``on_epoch_end``.
    Lines of any other moment (a mid-epoch evaluation) are logged at once. Rank 0 only."""

    def __init__(self, logger: logging.Logger):
        self.logger = logger
        self.pending: list[tuple[str, tuple]] = []

    def info(self, trainer: TrainerView, message: str, *args: Any) -> None:
        if not trainer.is_main:
            return
        if at_epoch_end(trainer):
            self.pending.append((message, args))
        else:
            self.logger.info(message, *args)

    def flush(self) -> None:
        for message, args in self.pending:
            self.logger.info(message, *args)
        self.pending.clear()
