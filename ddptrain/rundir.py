"""The layout of a run directory: the one place that names what a run writes where.

A run's directory is ``trainer.output_dir`` (by default ``outputs/<recipe>/<YYYY-MM-DD_HH-MM-SS>``,
the same on every rank). Rank 0 and the launcher write into it::

    train.log            the log (rank 0 and the launcher; every line in one format)
    error.log            the traceback of the rank that failed
    metrics.json         the final metrics, ``params_sha256`` and ``params_agree``
    test_metrics.json    what ``Trainer.test`` measured
    metrics.csv          every reduced metric (``trainer.loggers.csv``), with ``hparams.yaml`` beside it
    tensorboard/         TensorBoard event files (``trainer.loggers.tensorboard``)
    mlruns/              an MLflow file store (``trainer.loggers.mlflow``)
    profile/             torch.profiler traces, one per rank (``trainer.profiler.enabled``)
    doctor.json          the doctor's report, with ``doctor_trace.json`` (``trainer.doctor``)
    checkpoints/         ``step_<n>.pt``, the newest ``trainer.checkpoint.keep_last`` of them
    checkpoints/best/    the best ``trainer.checkpoint.save_top_k`` by ``trainer.checkpoint.monitor``

Hydra adds ``.hydra/`` (the composed config). This module imports nothing heavy: the command line
reads it before torch is imported.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

__all__ = ["RunDir", "BEST_DIR", "CHECKPOINTS_DIR", "LOG_FILE"]

CHECKPOINTS_DIR = "checkpoints"
BEST_DIR = "best"
"""Sub-directory of a run's ``checkpoints/`` that holds the best checkpoints."""
LOG_FILE = "train.log"


@dataclass(frozen=True)
class RunDir:
    """The paths of one run's files (nothing is created here).

    Args:
        root: the run directory.
    """

    root: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", Path(self.root))  # a str or any PathLike is accepted

    @property
    def checkpoints(self) -> Path:
        return self.root / CHECKPOINTS_DIR

    @property
    def best_checkpoints(self) -> Path:
        return self.checkpoints / BEST_DIR

    @property
    def log(self) -> Path:
        return self.root / LOG_FILE

    @property
    def error_log(self) -> Path:
        return self.root / "error.log"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.json"

    @property
    def test_metrics(self) -> Path:
        return self.root / "test_metrics.json"

    @property
    def metrics_csv(self) -> Path:
        return self.root / "metrics.csv"

    @property
    def tensorboard(self) -> Path:
        return self.root / "tensorboard"

    @property
    def mlruns(self) -> Path:
        return self.root / "mlruns"

    @property
    def profile(self) -> Path:
        return self.root / "profile"

    @property
    def doctor_report(self) -> Path:
        return self.root / "doctor.json"

    @property
    def doctor_trace(self) -> Path:
        return self.root / "doctor_trace.json"

    @staticmethod
    def checkpoints_in(path: str | os.PathLike) -> Path:
        """The checkpoint folder that ``path`` names: a run directory's ``checkpoints/``, or ``path``
        itself (a checkpoint folder, ``checkpoints/best`` included)."""
        path = Path(path)
        return path / CHECKPOINTS_DIR if (path / CHECKPOINTS_DIR).is_dir() else path
