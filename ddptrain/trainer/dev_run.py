"""``trainer.fast_dev_run``: prove in seconds that a recipe runs end to end, and keep nothing.

``true`` (1) or N runs N batches per rank of training, validation and test, on every launcher and
backend, with the run's own code paths (DDP, the sampler, the exact evaluation). What it turns off
is listed in :func:`dev_run_config`: the epochs beyond the first, the sanity check (the validation
runs anyway), checkpoints and every logger. The run's files go to a fresh temporary directory,
deleted when the run succeeds, so a successful dev run leaves nothing on disk; after a failure it
is kept, with the traceback in it.
"""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
from pathlib import Path

from ..config import Config

__all__ = ["dev_run_batches", "dev_run_config", "remove_dev_run_dir", "DEV_RUN_DIR_PREFIX"]

DEV_RUN_DIR_PREFIX = "ddptrain-fast-dev-run-"
"""The name of every temporary directory a fast dev run writes into starts with this."""


def dev_run_batches(config: Config) -> int:
    """The batches per rank ``trainer.fast_dev_run`` asks for; 0 when it is off."""
    return int(config.trainer.fast_dev_run)  # true: 1


def dev_run_config(config: Config) -> Config:
    """``config`` as a fast dev run runs it (unchanged when ``fast_dev_run`` is off): one epoch of
    N training batches, N validation batches, no sanity check, no checkpoints, no loggers, no
    profiler or doctor, and a temporary output directory. Idempotent."""
    n = dev_run_batches(config)
    if not n:
        return config
    t = config.trainer
    output_dir = t.output_dir
    if not (output_dir and Path(output_dir).name.startswith(DEV_RUN_DIR_PREFIX)):
        output_dir = tempfile.mkdtemp(prefix=DEV_RUN_DIR_PREFIX)
    trainer = dataclasses.replace(
        t,
        epochs=1,
        limit_train_batches=n,
        limit_val_batches=n,
        num_sanity_val_steps=0,
        eval_every_epochs=1,
        eval_every_steps=0,
        checkpoint=dataclasses.replace(t.checkpoint, every_epochs=0, every_steps=0, at_end=False, monitor=None),
        loggers=dataclasses.replace(t.loggers, tensorboard=False, csv=False, mlflow=False, wandb=False),
        profiler=dataclasses.replace(t.profiler, enabled=False),
        doctor=False,
        output_dir=output_dir,
    )
    return dataclasses.replace(config, trainer=trainer)


def remove_dev_run_dir(config: Config) -> None:
    """Delete a fast dev run's temporary directory (nothing else: the name must say it is one)."""
    output_dir = config.trainer.output_dir
    if dev_run_batches(config) and output_dir and Path(output_dir).name.startswith(DEV_RUN_DIR_PREFIX):
        shutil.rmtree(output_dir, ignore_errors=True)
