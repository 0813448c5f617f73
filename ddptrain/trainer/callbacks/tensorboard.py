"""TensorBoard event files on rank 0: training scalars, evaluation metrics, hyper-parameters.

Scalars (x axis: optimizer steps): ``train/loss`` (mean over ranks and the logging window),
``train/lr``, ``train/samples_per_s`` (all ranks), ``train/comm_wait_s`` (rank 0's mean time per
step waiting for gradient all-reduces after backward, from DDP's iteration stats),
``train/epoch_loss``, every evaluation metric as ``eval/<name>`` (``eval/loss``,
``eval/accuracy`` for the recipes), and what ``self.log`` reported. The composed configuration is
in the HParams tab (flattened, ``trainer.epochs`` ...).
"""

from __future__ import annotations

from pathlib import Path

from .base import TrainerView
from .loggers import MetricsLogger, flatten


class TensorBoardCallback(MetricsLogger):
    """Write scalars with ``torch.utils.tensorboard.SummaryWriter`` (rank 0 only).

    Args:
        log_dir: default ``<output_dir>/tensorboard``.
    """

    def __init__(self, log_dir: Path | None = None):
        super().__init__()
        self.log_dir = None if log_dir is None else Path(log_dir)
        self.writer = None

    def open(self, trainer: TrainerView, hparams: dict) -> None:
        from torch.utils.tensorboard import SummaryWriter  # imports tensorboard: rank 0 only
        from torch.utils.tensorboard.summary import hparams as hparams_summary

        if self.log_dir is None:
            self.log_dir = trainer.run_dir.tensorboard
        # After a resume, hide what an earlier run logged beyond the checkpoint's step.
        purge = trainer.state.step if trainer.state.step > 0 else None
        self.writer = SummaryWriter(str(self.log_dir), purge_step=purge)
        for summary in hparams_summary(flatten(hparams), {}):
            self.writer.file_writer.add_summary(summary)

    def write(self, metrics: dict[str, float], step: int) -> None:
        for name, value in metrics.items():
            self.writer.add_scalar(name, value, step)

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
        self.writer = None
