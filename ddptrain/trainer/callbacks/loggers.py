"""Loggers: where the reduced metrics of a run go, on rank 0, each with the run's hyper-parameters.

Every logger receives the same values: the training scalars of each logging window (``on_log``:
``train/loss``, ``train/lr``, ... and ``self.log``'s per-step values), every evaluation's metrics
(``on_validation_end``) and the epoch-level values (``on_epoch_end``: ``train/epoch_loss`` and
``self.log``'s epoch values), all at the optimizer step they belong to; and, once per fit, the
composed configuration as hyper-parameters.

- :class:`CSVLogger` (on by default, ``trainer.loggers.csv``): ``<run>/metrics.csv``, one row per step
  that logged anything, one column per metric; ``<run>/hparams.yaml``.
- ``TensorBoardCallback`` (``trainer.loggers.tensorboard``): event files, hyper-parameters in the HParams tab.
- :class:`MLflowLogger` (``trainer.loggers.mlflow``): an MLflow run in a local file store
  (``<run>/mlruns``), the configuration as parameters.
- :class:`WandbLogger` (``trainer.loggers.wandb``): a Weights & Biases run in offline mode under
  ``<run>/wandb`` (``wandb sync`` uploads it later), the configuration as its config.

MLflow and W&B are imported only when used: ``pip install ddptrain[loggers]``.
"""

from __future__ import annotations

import csv
import importlib
import json
import os
import time
from pathlib import Path
from typing import Any

from .base import Callback, TrainerView

__all__ = ["MetricsLogger", "CSVLogger", "MLflowLogger", "WandbLogger", "flatten", "import_optional"]


def flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` as ``{"a.b": 1}``; values other than str/int/float/bool become strings."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(flatten(value, name + "."))
        else:
            flat[name] = value if isinstance(value, (str, int, float, bool)) else json.dumps(value, default=str)
    return flat


def import_optional(module: str, logger: str):
    """Import an optional logger's package, or say how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(
            f"{logger} needs the {module!r} package ({exc}): pip install 'ddptrain[loggers]', or turn the logger off"
        ) from exc


class MetricsLogger(Callback):
    """Base of the loggers: routes the hooks to :meth:`open`, :meth:`write` and :meth:`close` on rank 0.

    Subclasses implement ``open(trainer, hparams)`` (``hparams``: the composed config as nested
    dicts), ``write(metrics, step)`` and ``close()``; ``flush()`` runs at every epoch end.
    """

    def __init__(self) -> None:
        self.active = False
        self._evaluated: set[str] = set()

    def on_fit_start(self, trainer: TrainerView) -> None:
        if trainer.is_main:
            self.open(trainer, trainer.config.to_dict())
            self.active = True

    def on_membership_change(self, trainer: TrainerView, change: Any) -> None:
        if trainer.is_main and not self.active:  # rank 0 was lost: this rank writes from now on
            self.on_fit_start(trainer)

    def on_log(self, trainer: TrainerView, scalars: dict[str, float]) -> None:
        self._write(scalars, trainer.state.step)

    def on_validation_end(self, trainer: TrainerView, metrics: dict[str, float]) -> None:
        self._evaluated = set(metrics)
        self._write(metrics, trainer.state.step)

    def on_epoch_end(self, trainer: TrainerView, epoch: int, metrics: dict[str, Any]) -> None:
        # The evaluation's metrics are in ``metrics`` too, already written by on_validation_end.
        self._write({k: v for k, v in metrics.items() if k != "epoch" and k not in self._evaluated}, trainer.state.step)
        self._evaluated = set()
        if self.active:
            self.flush()

    def on_fit_end(self, trainer: TrainerView, metrics: dict[str, Any]) -> None:
        self._close()

    def on_exception(self, trainer: TrainerView, exc: BaseException) -> None:
        self._close()

    def _write(self, metrics: dict[str, Any], step: int) -> None:
        numbers = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if self.active and numbers:
            self.write(numbers, step)

    def _close(self) -> None:
        if self.active:
            self.active = False
            self.close()

    def open(self, trainer: TrainerView, hparams: dict) -> None:
        raise NotImplementedError

    def write(self, metrics: dict[str, float], step: int) -> None:
        raise NotImplementedError

    def flush(self) -> None:
        """Make what was written so far durable (each epoch end)."""

    def close(self) -> None:
        self.flush()


class CSVLogger(MetricsLogger):
    """``metrics.csv``: a ``step`` column, then one column per metric in first-seen order; one row
    per step (values logged at the same step share it). Rewritten whole at each epoch end and at
    the end (new columns appear as metrics do). After a resume, rows beyond the resumed step are
    dropped, as TensorBoard's ``purge_step`` does.

    Args:
        path: default ``<output_dir>/metrics.csv`` (``hparams.yaml`` beside it).
    """

    def __init__(self, path: Path | None = None):
        super().__init__()
        self.path = None if path is None else Path(path)
        self.rows: dict[int, dict[str, float]] = {}
        self.columns: list[str] = []

    def open(self, trainer: TrainerView, hparams: dict) -> None:
        import yaml  # PyYAML comes with Hydra

        self.path = self.path or trainer.run_dir.metrics_csv
        self.rows, self.columns = {}, []
        if trainer.state.step > 0 and self.path.is_file():  # a resumed run keeps the rows up to its step
            with self.path.open(newline="") as f:
                for row in csv.DictReader(f):
                    if int(row["step"]) <= trainer.state.step:
                        self.write({k: float(v) for k, v in row.items() if k != "step" and v != ""}, int(row["step"]))
        self.path.parent.mkdir(parents=True, exist_ok=True)
        (self.path.parent / "hparams.yaml").write_text(yaml.safe_dump(hparams, sort_keys=False))

    def write(self, metrics: dict[str, float], step: int) -> None:
        self.rows.setdefault(step, {}).update(metrics)
        self.columns += [k for k in metrics if k not in self.columns]

    def flush(self) -> None:
        tmp = self.path.with_suffix(".csv.tmp")
        with tmp.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=["step", *self.columns])
            writer.writeheader()
            for step in sorted(self.rows):
                writer.writerow({"step": step, **self.rows[step]})
        tmp.replace(self.path)


class MLflowLogger(MetricsLogger):
    """An MLflow run: metrics at their step, the configuration as (flattened) parameters.

    Args:
        tracking_uri: default ``file:<output_dir>/mlruns`` (a local file store; MLflow 3 needs
            ``MLFLOW_ALLOW_FILE_STORE=true`` for it, which this logger sets unless it is set).
        experiment: the experiment's name.
        run_name: default the run directory's name.
    """

    def __init__(self, tracking_uri: str | None = None, experiment: str = "ddptrain", run_name: str | None = None):
        super().__init__()
        self.tracking_uri, self.experiment, self.run_name = tracking_uri, experiment, run_name
        self.client = self.run_id = None

    def open(self, trainer: TrainerView, hparams: dict) -> None:
        tracking = import_optional("mlflow.tracking", "MLflowLogger")
        entities = import_optional("mlflow.entities", "MLflowLogger")
        uri = self.tracking_uri or trainer.run_dir.mlruns.resolve().as_uri()
        if uri.startswith("file:"):  # MLflow 3 keeps its file store behind this switch (maintenance mode)
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = tracking.MlflowClient(tracking_uri=uri)
        found = self.client.get_experiment_by_name(self.experiment)
        experiment_id = found.experiment_id if found else self.client.create_experiment(self.experiment)
        run = self.client.create_run(experiment_id, run_name=self.run_name or trainer.output_dir.name)
        self.run_id = run.info.run_id
        params = [entities.Param(k, str(v)[:6000]) for k, v in flatten(hparams).items()]
        for i in range(0, len(params), 100):
            self.client.log_batch(self.run_id, params=params[i : i + 100])

    def write(self, metrics: dict[str, float], step: int) -> None:
        entities = import_optional("mlflow.entities", "MLflowLogger")
        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[entities.Metric(k, v, now, step) for k, v in metrics.items()])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


class WandbLogger(MetricsLogger):
    """A Weights & Biases run, offline by default (nothing leaves the machine until ``wandb sync``).

    Args:
        project: the W&B project.
        mode: ``"offline"`` (default), ``"online"`` or ``"disabled"``.
        run_name: default the run directory's name.
    """

    def __init__(self, project: str = "ddptrain", mode: str = "offline", run_name: str | None = None):
        super().__init__()
        self.project, self.mode, self.run_name = project, mode, run_name
        self.run = None

    def open(self, trainer: TrainerView, hparams: dict) -> None:
        wandb = import_optional("wandb", "WandbLogger")
        name = self.run_name or trainer.output_dir.name
        self.run = wandb.init(
            project=self.project, mode=self.mode, dir=str(trainer.output_dir), name=name, config=hparams, reinit=True
        )

    def write(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def close(self) -> None:
        self.run.finish()
