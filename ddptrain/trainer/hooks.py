"""The user's hooks: what a ``Trainer`` subclass overrides to say what to train, on what, and how.

These are Lightning's names, kept apart from the loop (:mod:`.trainer`) as LightningModule is
kept apart from Lightning's Trainer: this class says *what* (the model, the data, the losses, the
optimizers, the callbacks, how a step trains), the loop says *when*. Each default builds what the
config describes; a subclass overrides one at a time. ``self.config`` is the run's configuration;
the loop sets the rest (``total_steps`` before ``configure_optimizers``...).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

from ..config import Config, ConfigError
from ..data import DATASET_NAMES, prepare_dataset_files
from ..modes import mode_of
from ..objects import instantiate
from .callbacks import Callback
from .callbacks import from_config as callbacks_from_config
from .data import default_dataset
from .optimizers import build_optimizer, build_scheduler
from .steps import StepStrategy

__all__ = ["TrainingHooks"]


class TrainingHooks:
    """The hooks a :class:`~ddptrain.Trainer` subclass overrides (see the module docstring)."""

    config: Config
    total_steps: int  # the fit's optimizer steps, set before configure_optimizers

    @classmethod
    def prepare_data(cls, config: Config) -> None:
        """Make the data available once, before any worker starts (locate, decompress, fail early).

        Runs in the launching process (or on every rank under an external launcher, so it must be
        safe to run concurrently). The default finds and checks the files of the splits of
        ``config.data.name`` that the default data hooks would read, without loading them
        (``ddptrain.data.prepare_dataset_files``): a subclass that overrides ``train_dataloader``
        (or ``val_dataloader``) brings its own data, and nothing is looked for.
        """
        for train, hook in ((True, "train_dataloader"), (False, "val_dataloader")):
            if getattr(cls, hook) is not getattr(TrainingHooks, hook):
                continue  # the subclass brings its own data
            if config.data.name not in DATASET_NAMES:
                raise ConfigError(
                    f"data.name={config.data.name!r} is not one of ddptrain's datasets ({', '.join(DATASET_NAMES)}); "
                    f"to train on other data, override {hook} in {cls.__name__}"
                )
            prepare_dataset_files(config.data.name, config.data.root, train=train, download=config.data.download)

    def configure_model(self) -> nn.Module:
        """The model to train (on CPU; ``fit`` moves it). Default: ``config.model['_target_'](**rest)``."""
        return instantiate(self.config.model, "model", f"override {type(self).__name__}.configure_model")

    def configure_optimizers(self, model: nn.Module):
        """An optimizer, or ``(optimizer, scheduler)`` with a scheduler stepped per optimizer step.

        Also accepted: several optimizers (each steps and zeroes its own parameters every step) and
        Lightning's dict ``{"optimizer": ..., "lr_scheduler": {"scheduler": ..., "interval":
        "step" | "epoch", "monitor": ...}}`` (``ReduceLROnPlateau`` included); see
        :mod:`ddptrain.trainer.optimizers`. Anything else is refused with a ConfigError.
        """
        optimizer = build_optimizer(self.config.optimizer, model.parameters())
        return optimizer, build_scheduler(self.config.optimizer, optimizer, self.total_steps)

    def train_dataloader(self) -> Dataset | DataLoader:
        """The training data: a Dataset, which every rank builds whole (ddptrain's
        ``DistributedSampler`` picks this rank's share), or a DataLoader, whose sampler is replaced;
        the rule is in :mod:`.dataloaders`. Default: ``config.data``'s training split."""
        return default_dataset(self.config.data, train=True)

    def val_dataloader(self) -> Dataset | DataLoader | None:
        """The validation data, as ``train_dataloader`` (``None``: no evaluation). Default:
        ``config.data``'s evaluation split (for MNIST its test split)."""
        return default_dataset(self.config.data, train=False)

    def training_step(self, model: nn.Module, batch: Any) -> torch.Tensor:
        """The loss of one micro-batch (a scalar). ``model`` is the DDP wrapper: call it.

        The smoke check (``trainer.smoke_check``) also calls it with the bare module, in eval mode
        and under ``no_grad``, to measure the loss on fixed samples before and after training.
        """
        inputs, targets = batch
        return F.cross_entropy(model(inputs), targets)

    def validation_step(self, model: nn.Module, batch: Any) -> dict[str, torch.Tensor]:
        """Per-sample metrics of one batch: ``{name: tensor of shape [batch]}``.

        The Trainer drops padding duplicates and averages each metric over exactly the whole
        validation set across ranks. ``model`` is the bare module, in eval mode, under no_grad.
        """
        inputs, targets = batch
        logits = model(inputs)
        return {
            "loss": F.cross_entropy(logits, targets, reduction="none"),
            "accuracy": (logits.argmax(dim=1) == targets).float(),
        }

    def test_dataloader(self) -> Dataset | DataLoader | None:
        """The data of ``test()`` without an argument. Default: ``val_dataloader()``."""
        return self.val_dataloader()

    def test_step(self, model: nn.Module, batch: Any) -> dict[str, torch.Tensor]:
        """Per-sample metrics of one test batch, ``{name: tensor of shape [batch]}``. Default: ``validation_step``."""
        return self.validation_step(model, batch)

    def predict_step(self, model: nn.Module, batch: Any) -> Any:
        """The outputs of one batch, one row per sample (a tensor, or a tuple/list/dict of tensors).

        Default: ``model(inputs)``, the inputs being the batch's first entry when it is a tuple or list.
        """
        return model(batch[0] if isinstance(batch, (tuple, list)) else batch)

    def configure_step_strategy(self, votes: Callable[[], list[float]]) -> StepStrategy:
        """How a step's micro-batches become a parameter update (:mod:`.steps`), given this rank's
        stop votes to carry in the step's reduction. Default: the strategy of the config's mode
        (:func:`ddptrain.modes.mode_of`: plain DDP, ZeRO, local SGD / DiLoCo, invariant shards, an
        elastic job's shared batches, or a registered one). Called once per fit, after the model,
        data and optimizers are built, and again in an elastic job after each membership change
        (for the new group)."""
        return mode_of(self.config).strategy_class()(self, votes)

    def configure_callbacks(self) -> list[Callback]:
        """The built-in callbacks the config asks for: progress, TensorBoard, checkpoints."""
        return callbacks_from_config(self.config.trainer)
