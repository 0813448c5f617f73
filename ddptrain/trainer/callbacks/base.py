"""The callback interface: hooks the Trainer calls on every rank, in a fixed order.

Every hook runs on every rank, so a callback may use collectives (all ranks reach the same hooks
at the same steps); one that writes files or prints checks ``trainer.is_main`` first.

Order within one fit: ``on_fit_start`` → per epoch ``on_epoch_start`` → per optimizer step
``on_train_batch_end`` (and ``on_log`` every ``trainer.log_every_steps``) → ``on_validation_end``
after each evaluation → ``on_epoch_end`` → ... → ``on_fit_end``. ``on_exception`` replaces
``on_fit_end`` when training fails.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the trainer imports callbacks; annotations only here
    from ..trainer import Trainer


class Callback:
    """Base class: override the hooks you need; each default does nothing."""

    def on_fit_start(self, trainer: Trainer) -> None:
        """Everything is built (and resumed); no step has run yet in this fit."""

    def on_epoch_start(self, trainer: Trainer, epoch: int) -> None:
        """Epoch ``epoch`` (0-based) starts, possibly in its middle after a resume."""

    def on_train_batch_end(self, trainer: Trainer, loss: float) -> None:
        """An optimizer step finished; ``loss`` is this rank's mean over its micro-batches and
        ``trainer.state.step`` counts the steps done."""

    def on_log(self, trainer: Trainer, scalars: dict[str, float]) -> None:
        """Scalars reduced over all ranks (``train/loss``, ``train/lr``, ...), at ``trainer.state.step``."""

    def on_validation_end(self, trainer: Trainer, metrics: dict[str, float]) -> None:
        """An evaluation finished; ``metrics`` are exact over the whole validation set."""

    def on_epoch_end(self, trainer: Trainer, epoch: int, metrics: dict[str, Any]) -> None:
        """Epoch ``epoch`` is complete (``trainer.state.epoch`` is already the next one)."""

    def on_fit_end(self, trainer: Trainer, metrics: dict[str, Any]) -> None:
        """Training stopped normally; ``metrics`` is what ``fit`` returns."""

    def on_exception(self, trainer: Trainer, exc: BaseException) -> None:
        """Training failed with ``exc`` (it is re-raised after the callbacks ran)."""
