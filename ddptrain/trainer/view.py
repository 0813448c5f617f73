"""What the loop's parts see of the Trainer: :class:`LoopView`, written down once.

Step strategies (:mod:`.steps`), the checkpointer (:meth:`.checkpoint.Checkpointer.of`) and the
validation pass (:mod:`.evaluation`) take the Trainer as a ``LoopView``, not as ``Any``: this list
is everything they may read or call, so a reader knows what a strategy can touch without reading
the Trainer, and a test can hand them any object that has these. Callbacks see less: their own
:class:`.callbacks.TrainerView`. It imports none of its users' modules (they import it), so four
attributes are typed ``Any`` with their type named beside them.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch
    from torch import nn
    from torch.utils.data import Dataset

    from ..comm import ProcessGroup
    from ..config import Config
    from ..data import DistributedSampler
    from ..ddp import DistributedDataParallel
    from ..rundir import RunDir
    from .ema import EmaWeights
    from .metrics import LoggedMetrics, TrainingMetrics
    from .optimizers import OptimizerSet
    from .precision import Precision
    from .profiling import StepPhases

__all__ = ["LoopView"]


class LoopView(Protocol):
    """The Trainer as its strategies, checkpointer and evaluation see it (set up by ``fit``).

    Attributes:
        config: the run's configuration.
        rank: this rank's number in ``process_group``.
        world_size: the number of ranks.
        device: this rank's device.
        is_main: True on rank 0.
        process_group: the job's ranks (``ddptrain.comm.ProcessGroup``).
        model: the DDP wrapper; ``model.module`` is the user's model.
        optimizer_set: every optimizer of ``configure_optimizers`` with its schedules.
        precision: autocast and the gradient scaler (``trainer.precision``).
        state: the step, and through the sampler the epoch and position in it.
        strategy: the step strategy (``None`` before ``setup`` picks it).
        ema: the weights' moving average (``trainer.ema``), or None.
        elastic: the membership of an elastic job (``trainer.elastic``), or None.
        callbacks: the fit's callbacks (their states go into checkpoints).
        metrics: the fit's training metrics (logging windows, the loss history).
        logged: what ``self.log`` collected, until the next reduction.
        callback_metrics: the latest value of every reduced metric.
        phases: each step's phases, announced to listeners (the doctor).
        run_dir / output_dir: the paths of this run's files, and their directory.
        train_set / train_sampler / train_loader_options: the training data, its sampler, and
            what a ``train_dataloader`` DataLoader asked for (collate_fn, workers...).
        val_sampler: the validation sampler (None without validation data).
        batch_size: samples per rank per micro-batch.
        steps_per_epoch / total_steps: optimizer steps in a full epoch, and in the fit.
    """

    config: Config
    rank: int
    world_size: int
    device: torch.device
    process_group: ProcessGroup
    model: DistributedDataParallel
    optimizer_set: OptimizerSet
    precision: Precision
    state: Any  # .checkpoint.TrainState (which imports this module)
    strategy: Any  # .steps.StepStrategy, or None before setup (steps imports this module)
    ema: EmaWeights | None
    elastic: Any  # .elastic.ElasticTraining or None (elastic imports this module)
    callbacks: list[Any]  # .callbacks.Callback (whose checkpointer imports this module)
    metrics: TrainingMetrics
    logged: LoggedMetrics
    callback_metrics: dict[str, float]
    phases: StepPhases
    train_set: Dataset
    train_sampler: DistributedSampler
    train_loader_options: Any
    val_sampler: DistributedSampler | None
    batch_size: int
    steps_per_epoch: int
    total_steps: int
    output_dir: Path

    @property
    def is_main(self) -> bool: ...

    @property
    def run_dir(self) -> RunDir: ...

    def training_step(self, model: nn.Module, batch: Any) -> torch.Tensor:
        """The user's loss of one micro-batch."""

    def validation_step(self, model: nn.Module, batch: Any) -> dict[str, torch.Tensor]:
        """The user's per-sample metrics of one validation batch."""

    def train_batches(self) -> Iterator[Any]:
        """The rest of this epoch's micro-batches for this rank."""

    def val_batches(self) -> Iterator[Any]:
        """One pass over this rank's share of the validation set."""

    def log(self, name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        """Report a metric, reduced over the ranks (``Trainer.log``)."""
